"""Near-duplicate removal: MinHash over character shingles and LSH banding, partitioned like exact dedup.

A sentence's *shingles* are its character n-grams (``shingle`` characters; a shorter sentence is one
shingle). Its MinHash signature holds ``bands * rows`` minima of the shingles under as many seeded
hash functions; two sentences agree on one of them with probability equal to the Jaccard similarity
of their shingle sets. LSH banding: the signature is cut into ``bands`` bands of ``rows`` values and
each band is hashed to 64 bits (the band's index mixed in). Two sentences that share a band hash are
*candidates*; the chance is ``1 - (1 - J^rows)^bands`` for Jaccard J, an S-curve around
``(1/bands)^(1/rows)``.

The rule: in every group of sentences sharing a band hash, every sentence but the one with the
smallest shuffle key is a near duplicate and is dropped. It needs nothing but the (band hash, key)
pairs, so it is partitioned like exact dedup:

  split  (pass 1)  every kept sentence -> ``bands`` (band hash, key) pairs, routed to *bucket*
                   ``floor(band_hash * Q / 2^64)`` and written beside the unit's sentences;
  dedup  (pass 2)  one piece per bucket: gather it from every unit, sort by (band hash, key), write
                   the dropped keys grouped by key partition (exact repeats of a sentence share the
                   key, so they are not near duplicates of each other; exact dedup handles them);
  shards (pass 3)  each key partition leaves out the rows whose key any bucket dropped.

Memory per piece is 1/Q of the (band hash, key) pairs (16 bytes x bands per sentence), and the result
depends on the texts, the seed and these options only, not on Q, units or workers. A sentence whose
only near duplicates are themselves dropped may still be dropped (the groups are not merged into
clusters first): the rule over-removes a little inside chains, never keeps two members of one group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_MASK32 = np.uint64(0xFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class NearDupParams:
    shingle: int = 3  # characters per shingle
    bands: int = 10
    rows: int = 6  # MinHash values per band; bands * rows hash functions in all

    @property
    def threshold(self) -> float:
        """Jaccard similarity at which a pair becomes a candidate with probability about 1/2."""
        return (1.0 / self.bands) ** (1.0 / self.rows)

    def candidate_probability(self, jaccard: float) -> float:
        return 1.0 - (1.0 - jaccard**self.rows) ** self.bands


def _mix64(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer on a uint64 array (wraps mod 2^64, as intended)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _hash_parameters(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` (xor mask, odd multiplier) pairs of 32-bit hash functions, fixed by ``seed``."""
    state = _mix64(np.arange(1, 2 * count + 1, dtype=np.uint64) * _GOLDEN ^ np.uint64(seed))
    masks = (state[:count] & _MASK32).astype(np.uint32)
    multipliers = ((state[count:] >> np.uint64(32)).astype(np.uint32)) | np.uint32(1)
    return masks, multipliers


def signatures(sentences: list[str], params: NearDupParams, seed: int = 0) -> np.ndarray:
    """MinHash signatures, shape ``(len(sentences), bands * rows)``, uint32.

    Vectorised over the batch: the shingle hashes of all sentences are one array, and each hash
    function is one multiply and one ``minimum.reduceat`` over it. The hash functions are
    ``(x ^ mask) * multiplier mod 2^32`` on a well-mixed 32-bit shingle hash ``x``.
    """
    n = len(sentences)
    num = params.bands * params.rows
    if n == 0:
        return np.zeros((0, num), np.uint32)
    k = params.shingle
    lengths = np.fromiter(map(len, sentences), dtype=np.int64, count=n)
    codes = np.frombuffer("".join(sentences).encode("utf-32-le", "surrogatepass"), dtype="<u4")
    codes = codes.astype(np.uint64)
    starts = np.cumsum(lengths) - lengths
    # the hash of the k characters from each position (positions near a sentence end are cut off below)
    total = len(codes)
    h = np.zeros(total, np.uint64)
    for j in range(k):
        shifted = np.zeros(total, np.uint64)
        shifted[: total - j] = codes[j:]
        h = (h ^ shifted) * np.uint64(0x100000001B3) + np.uint64(j + 1)
    counts = np.maximum(lengths - k + 1, 1)  # shingles per sentence (a short one is a single shingle)
    position = np.arange(total) - np.repeat(starts, lengths)
    valid = position < np.repeat(counts, lengths)
    # a shingle of a sentence shorter than k must not see the next sentence's characters
    short = lengths < k
    if short.any():
        for i in np.flatnonzero(short).tolist():
            piece = codes[starts[i] : starts[i] + lengths[i]]
            value = np.uint64(0)
            for j, c in enumerate(piece.tolist()):
                value = (value ^ np.uint64(c)) * np.uint64(0x100000001B3) + np.uint64(j + 1)
            h[starts[i]] = value
    x = (_mix64(h[valid] ^ np.uint64(seed)) >> np.uint64(32)).astype(np.uint32)
    first = np.cumsum(counts) - counts
    masks, multipliers = _hash_parameters(num, seed)
    out = np.empty((n, num), np.uint32)
    for p in range(num):
        out[:, p] = np.minimum.reduceat((x ^ masks[p]) * multipliers[p], first)
    return out


def band_hashes(signature: np.ndarray, params: NearDupParams) -> np.ndarray:
    """One 64-bit hash per band, shape ``(n, bands)``; the band index is mixed in, so equal values
    in different bands never meet."""
    n = signature.shape[0]
    sig = signature.astype(np.uint64).reshape(n, params.bands, params.rows)
    seeds = (np.arange(params.bands, dtype=np.uint64) + np.uint64(1)) * _GOLDEN
    h = np.broadcast_to(seeds, (n, params.bands))
    for r in range(params.rows):
        h = _mix64(h ^ sig[:, :, r])
    return np.ascontiguousarray(h)


def near_duplicates(bands: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rule on (band hash, key) pairs: in each group of equal band hashes every key but the
    smallest is dropped. Returns the dropped keys (unique, sorted) and, for each, the smallest key of
    a group it was dropped from (the sentence it duplicates)."""
    if len(bands) == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    order = np.lexsort((keys, bands))
    b, k = bands[order], keys[order]
    # exact repeats of one (band, key) pair: the same sentence seen in several units
    fresh = np.r_[True, (b[1:] != b[:-1]) | (k[1:] != k[:-1])]
    b, k = b[fresh], k[fresh]
    group_start = np.r_[True, b[1:] != b[:-1]]
    first_index = np.maximum.accumulate(np.where(group_start, np.arange(len(b)), 0))
    dropped = ~group_start
    drop_keys, kept_keys = k[dropped], k[first_index[dropped]]
    unique, index = np.unique(drop_keys, return_index=True)
    return unique, kept_keys[index]


def drop_sets(texts: list[str], keys: np.ndarray, params: NearDupParams, seed: int = 0) -> np.ndarray:
    """In-memory form of the whole rule (for measurements and tests): the keys dropped among ``texts``."""
    hashes = band_hashes(signatures(texts, params, seed), params)
    dropped, _ = near_duplicates(hashes.ravel(), np.repeat(keys, params.bands))
    return dropped
