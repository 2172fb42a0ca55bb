"""Each objective against a literal (loop-by-loop) implementation of its formula, in one process."""

import math

import pytest
import torch
import torch.nn.functional as F
from _tensors import leaf, unit

from pipeline.errors import ConfigError
from pipeline.losses import (
    TERMS,
    LossTerm,
    build_loss,
    cosent,
    multi_positive,
    pairwise_bce,
    sbert_softmax,
    simcse,
    sup_simcse,
)
from pipeline.model.heads import SoftmaxHead

TAU = 0.05


# ------------------------------------------------------------------------------- literal references
def literal_multi_positive(emb, tau, queue=None, keep_self=False):
    """Loop over anchors; candidates: every (view, sentence) but the anchor (unless keep_self)."""
    n, b, _ = emb.shape
    total = 0.0
    for v in range(n):
        for i in range(b):
            a = emb[v, i]
            cands, positive_cols = [], []
            for w in range(n):
                for j in range(b):
                    if (w, j) == (v, i) and not keep_self:
                        continue
                    if j == i and w != v:
                        positive_cols.append(len(cands))
                    cands.append(torch.dot(a, emb[w, j]) / tau)
            if queue is not None:
                cands += [torch.dot(a, q) / tau for q in queue]
            log_z = torch.logsumexp(torch.stack(cands), 0)
            total = total - sum(cands[c] - log_z for c in positive_cols) / (n - 1)
    return total / (n * b)


def literal_simcse(emb, tau):
    """Gao et al. 2021, eq. 1, one direction: anchors view 0, candidates view 1."""
    h, h_plus = emb[0], emb[1]
    b = h.shape[0]
    total = 0.0
    for i in range(b):
        numer = torch.exp(F.cosine_similarity(h[i], h_plus[i], dim=0) / tau)
        denom = sum(torch.exp(F.cosine_similarity(h[i], h_plus[j], dim=0) / tau) for j in range(b))
        total = total - torch.log(numer / denom)
    return total / b


def literal_sup_simcse(h, h_plus, h_minus, tau):
    """Gao et al. 2021, eq. 5."""
    b = h.shape[0]
    total = 0.0
    for i in range(b):
        numer = torch.exp(F.cosine_similarity(h[i], h_plus[i], dim=0) / tau)
        denom = sum(
            torch.exp(F.cosine_similarity(h[i], h_plus[j], dim=0) / tau)
            + torch.exp(F.cosine_similarity(h[i], h_minus[j], dim=0) / tau)
            for j in range(b)
        )
        total = total - torch.log(numer / denom)
    return total / b


def literal_cosent(u, v, labels, scale):
    cos = [F.cosine_similarity(u[i], v[i], dim=0) for i in range(len(labels))]
    total = torch.ones((), dtype=u.dtype)
    for i in range(len(labels)):
        for j in range(len(labels)):
            if labels[i] > labels[j]:
                total = total + torch.exp(scale * (cos[j] - cos[i]))
    return torch.log(total)


def assert_same_loss_and_grad(fn_a, fn_b, *tensors):
    xs_a = [leaf(t) for t in tensors]
    xs_b = [leaf(t) for t in tensors]
    loss_a, loss_b = fn_a(*xs_a), fn_b(*xs_b)
    torch.testing.assert_close(loss_a, loss_b)
    loss_a.backward()
    if not loss_b.requires_grad:  # the reference is a constant: our gradient must vanish
        assert all(torch.count_nonzero(a.grad) == 0 for a in xs_a)
        return
    loss_b.backward()
    for a, b in zip(xs_a, xs_b):
        torch.testing.assert_close(a.grad, b.grad)


# -------------------------------------------------------------------------------------- multi-positive
@pytest.mark.parametrize("n_views", [2, 3, 5])
def test_multi_positive_matches_literal(n_views):
    emb = unit(n_views, 4, 8, seed=n_views)
    assert_same_loss_and_grad(
        lambda e: multi_positive.compute_loss(e, TAU, gather=False),
        lambda e: literal_multi_positive(e, TAU),
        emb,
    )


def test_multi_positive_with_queue_matches_literal_and_queue_gets_no_grad():
    emb, queue = unit(3, 4, 8, seed=1), unit(6, 8, seed=2)
    assert_same_loss_and_grad(
        lambda e: multi_positive.compute_loss(e, 0.1, queue=queue, gather=False),
        lambda e: literal_multi_positive(e, 0.1, queue=queue),
        emb,
    )
    q = leaf(queue)
    multi_positive.compute_loss(leaf(emb), queue=q).backward()
    assert q.grad is None
    # the queue adds negatives: the loss must grow
    assert multi_positive.compute_loss(emb, queue=queue) > multi_positive.compute_loss(emb)


def test_multi_positive_excludes_self_similarity():
    emb = unit(3, 4, 8, seed=3)
    ours = multi_positive.compute_loss(emb, TAU, gather=False)
    with_self = literal_multi_positive(emb, TAU, keep_self=True)  # LUSE's variant
    assert not torch.isclose(ours, with_self)
    torch.testing.assert_close(ours, literal_multi_positive(emb, TAU))


def test_multi_positive_lower_bound_reached_by_perfect_embeddings():
    # views of a sentence identical, sentences orthogonal: p(each positive) -> 1/(n-1)
    n, b = 4, 3
    emb = torch.eye(b, 8, dtype=torch.float64).expand(n, b, 8)
    loss = multi_positive.compute_loss(emb, 0.01, gather=False)
    assert loss == pytest.approx(math.log(n - 1), abs=1e-6)
    assert multi_positive.compute_loss(unit(n, b, 8), 0.01) > loss + 1


def test_multi_positive_gather_is_identity_in_one_process():
    emb = unit(3, 5, 8, seed=4)
    torch.testing.assert_close(
        multi_positive.compute_loss(emb, gather=True), multi_positive.compute_loss(emb, gather=False)
    )


def test_multi_positive_is_not_simcse_at_two_views():
    emb = unit(2, 4, 8, seed=5)
    assert not torch.isclose(multi_positive.compute_loss(emb), simcse.compute_loss(emb))


def test_multi_positive_rejects_single_view():
    with pytest.raises(ValueError, match="n_views >= 2"):
        multi_positive.compute_loss(unit(1, 4, 8))


def test_multi_positive_loss_falls_when_training_a_tiny_encoder():
    torch.manual_seed(0)
    sentences = torch.randn(16, 12)
    views = sentences + 0.3 * torch.randn(3, 16, 12)  # three noisy views per "sentence"
    encoder = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    optimizer = torch.optim.Adam(encoder.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = multi_positive.compute_loss(F.normalize(encoder(views), dim=-1), temperature=0.1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


# ------------------------------------------------------------------------------------------- SimCSE
def test_simcse_matches_paper_formula():
    # Raw vectors: the encoder L2-normalises before the loss, the paper's sim is the cosine.
    raw = 3 * unit(2, 6, 8, seed=6)
    assert_same_loss_and_grad(
        lambda e: simcse.compute_loss(F.normalize(e, dim=-1), TAU, gather=False),
        lambda e: literal_simcse(e, TAU),
        raw,
    )


def test_simcse_is_one_directional():
    emb = unit(2, 6, 8, seed=7)
    swapped = emb.flip(0)
    assert not torch.isclose(simcse.compute_loss(emb), simcse.compute_loss(swapped))


def test_sup_simcse_matches_paper_formula():
    a, p, n = 2 * unit(5, 8, seed=8), 3 * unit(5, 8, seed=9), unit(5, 8, seed=10)
    assert_same_loss_and_grad(
        lambda *x: sup_simcse.compute_loss(
            *(F.normalize(t, dim=-1) for t in x), temperature=TAU, gather=False
        ),
        lambda *x: literal_sup_simcse(*x, TAU),
        a,
        p,
        n,
    )


# ------------------------------------------------------------------------------------------- CoSENT
@pytest.mark.parametrize(
    "labels", [[0.0, 1.0, 2.0, 5.0, 3.0, 3.0], [0.0, 1.0, 1.0, 0.0, 1.0, 0.0], [2.0] * 6]
)
def test_cosent_matches_literal(labels):
    u, v = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)  # not normalised
    y = torch.tensor(labels, dtype=torch.float64)
    assert_same_loss_and_grad(
        lambda a, b: cosent.compute_loss(a, b, y, 20.0), lambda a, b: literal_cosent(a, b, y, 20.0), u, v
    )


def test_cosent_all_equal_labels_give_log_one():
    u = unit(4, 8)
    assert float(cosent.compute_loss(u, unit(4, 8, seed=1), torch.ones(4))) == pytest.approx(0.0)


def test_cosent_prefers_correct_order():
    u = unit(2, 8, seed=11)
    v_good = torch.stack([u[0], -u[1]])  # label-1 pair similar, label-0 pair dissimilar
    labels = torch.tensor([1.0, 0.0])
    good = cosent.compute_loss(u, v_good, labels)
    bad = cosent.compute_loss(u, v_good, labels.flip(0))
    assert good < 1e-6 < 1 < bad


# ------------------------------------------------------------------------------------- Sentence-BERT
def test_sbert_softmax_is_cross_entropy_over_u_v_absdiff():
    torch.manual_seed(0)
    head = SoftmaxHead(8, num_labels=3)
    u, v = unit(5, 8).float(), unit(5, 8, seed=1).float()
    labels = torch.tensor([0.0, 1.0, 2.0, 1.0, 0.0])
    loss = sbert_softmax.compute_loss(u, v, labels, head)
    w, bias = head.classifier.weight, head.classifier.bias
    expected = 0.0
    for i in range(5):
        logits = w @ torch.cat([u[i], v[i], (u[i] - v[i]).abs()]) + bias
        expected -= torch.log_softmax(logits, 0)[int(labels[i])]
    torch.testing.assert_close(loss, expected / 5)
    assert set(head.state_dict()) == {"classifier.weight", "classifier.bias"}
    assert head.classifier.weight.shape == (3, 24)


# ------------------------------------------------------------------------------------ luse_bce
def luse_bce_literal(views):
    """DunZhang/LUSE code/Train.py, train_once and train, loss_type "bce", transcribed: the masks by its
    loops, the diagonal set to 0.99999 in place, (1 + scores) / 2, F.binary_cross_entropy."""
    n, batch_size, _ = views.shape
    aug_count = n - 1
    aug_vecs = views.reshape(n * batch_size, -1)  # bsz*n, hiddensize (its order: augmented, then original)
    mask_for_batch_pos = torch.zeros((batch_size * (aug_count + 1), batch_size * (aug_count + 1)))
    mask_for_diag = torch.zeros((batch_size * (aug_count + 1), batch_size * (aug_count + 1)))
    for i in range(mask_for_batch_pos.shape[0]):
        mask_for_diag[i, i] = 1
        for j in range(1 + aug_count):
            mask_for_batch_pos[i, i % batch_size + j * batch_size] = 1
    mask_for_diag = mask_for_diag.bool()
    mask_for_batch_pos = mask_for_batch_pos.to(views.dtype)
    scores = aug_vecs.mm(aug_vecs.t())
    scores.masked_fill_(mask_for_diag, 0.99999)
    scores = (1 + scores) / 2
    return F.binary_cross_entropy(scores, mask_for_batch_pos)


@pytest.mark.parametrize("n_views", [1, 2, 5])
def test_luse_bce_matches_the_literal_code(n_views):
    views = unit(n_views, 6, 8)
    got = pairwise_bce.compute_loss(leaf(views), gather=False)
    torch.testing.assert_close(got, luse_bce_literal(views), rtol=1e-12, atol=1e-12)
    # LUSE orders views augmented-first; a mean over all pairs does not depend on the order
    rolled = torch.roll(views, 1, dims=0)
    torch.testing.assert_close(pairwise_bce.compute_loss(rolled, gather=False), luse_bce_literal(views))


def test_luse_bce_falls_when_training_a_tiny_encoder():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 6).double()
    x = torch.randn(3, 8, 6, dtype=torch.float64)
    x[1:] = x[0] + 0.1 * torch.randn(2, 8, 6, dtype=torch.float64)  # views = noisy copies of the original
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(30):
        loss = pairwise_bce.compute_loss(F.normalize(model(x), dim=-1), gather=False)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


# ----------------------------------------------------------------------------------------- registry
def test_registry_names_inputs_and_unknown_name():
    main = {n for n, t in TERMS.items() if t.data is not None}  # the terms that decide the data
    assert main == {"luse", "simcse", "sup_simcse", "cosent", "sbert", "luse_bce", "pairs"}
    assert set(TERMS) - main == {"distill", "kl", "mlm", "matryoshka"}
    luse, cosent = TERMS["luse"], TERMS["cosent"]
    assert "views" in luse.reads(luse.config_class())
    assert cosent.reads(cosent.config_class()) == {"pairs", "labels"}
    assert all(issubclass(t, LossTerm) and t.forward is not LossTerm.forward for t in TERMS.values())
    assert [n for n, t in TERMS.items() if "queue" in t.reads(t.config_class()) and t.data] == ["luse"]
    with pytest.raises(ConfigError, match="one of luse"):
        build_loss([{"simcsee": {}}])
