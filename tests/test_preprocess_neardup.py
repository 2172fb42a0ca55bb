import numpy as np

from pipeline.stages.corpus.neardup import NearDupParams, band_hashes, near_duplicates, signatures


def _jaccard(a: str, b: str, k: int = 3) -> float:
    sa, sb = ({s[i : i + k] for i in range(len(s) - k + 1)} for s in (a, b))
    return len(sa & sb) / len(sa | sb)


def test_minhash_agreement_estimates_the_shingle_jaccard():
    base = "国务院副总理钱其琛今天在人民大会堂会见了来访的摩洛哥外交大臣一行并举行会谈"
    variants = [base[:i] + "某" + base[i + 1 :] for i in (5, 20)] + [
        base[:30],
        base[10:],
        "完全无关的另一句话说的是天气",
    ]
    params = NearDupParams(shingle=3, bands=32, rows=8)  # 256 values: a close estimate
    sig = signatures([base, *variants], params)
    assert sig.shape == (6, 256) and sig.dtype == np.uint32
    for i, v in enumerate(variants, start=1):
        agreement = float((sig[0] == sig[i]).mean())
        assert abs(agreement - _jaccard(base, v)) < 0.1, (v, agreement, _jaccard(base, v))
    # a batch gives every sentence the signature it has alone (no shingle crosses a sentence)
    assert np.array_equal(signatures([variants[1]], params)[0], sig[2])


def test_band_hashes_match_only_where_a_whole_band_matches():
    params = NearDupParams(shingle=3, bands=4, rows=2)
    sig = np.array([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 9, 9, 9, 9, 9, 9], [2, 1, 3, 4, 9, 9, 9, 9]], np.uint32)
    h = band_hashes(sig, params)
    assert h[0, 0] == h[1, 0] and h[0, 1] == h[2, 1]  # band 0 of rows 0/1, band 1 of rows 0/2
    assert h[0, 0] != h[2, 0]  # the same values in another order are another band
    assert len(set(h[1, 2:].tolist())) == 2  # equal values in different bands never meet


def test_rule_keeps_the_smallest_key_of_each_group_and_ignores_exact_repeats():
    bands = np.array([10, 10, 10, 20, 20, 30, 10, 40, 40], np.uint64)
    keys = np.array([5, 3, 9, 9, 7, 1, 3, 2, 2], np.uint64)  # (10, 3) twice; (40, 2) twice: one sentence
    dropped, matches = near_duplicates(bands, keys)
    # group 10: keys 3, 5, 9 -> 5 and 9 dropped (match 3); group 20: keys 7, 9 -> 9 dropped (match 7)
    assert dropped.tolist() == [5, 9] and matches.tolist()[0] == 3
    assert near_duplicates(np.zeros(0, np.uint64), np.zeros(0, np.uint64))[0].size == 0


def test_shipped_setting_separates_reposts_from_distinct_sentences():
    params = NearDupParams()
    assert abs(params.threshold - 0.68) < 0.01
    assert params.candidate_probability(0.9) > 0.99 and params.candidate_probability(0.3) < 0.01
    base = "据新华社北京1月3日电，邮电部今天发行《戊寅年》特种邮票一套两枚，全国各地邮局同时出售。"
    texts = [base, base + "（转载）", "外交部发言人今天在例行记者会上回答了记者关于中东和平进程的提问。"]
    hashes = band_hashes(signatures(texts, params), params)
    assert (hashes[0] == hashes[1]).any() and not (hashes[0] == hashes[2]).any()
