"""The calibration levers of a recipe's streams, as documented: ``min_bits`` is a floor every
component keeps; ``fisher_shrink = 0`` is the measured sensitivity alone (the codecs of before the
lever existed), ``= 1`` the calibration-free prior alone (``identity`` or ``proxy``), and what
lies between changes the allocation."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kakeyaturbo import recipes
from kakeyaturbo.calibration import AttentionStats, Sensitivity, allocate_bits, model_codec
from kakeyaturbo.calibration.allocation import LLOYD_MAX_MSE, global_allocation
from kakeyaturbo.calibration.fit import shrink_fisher
from kakeyaturbo.errors import InvalidParameterError

L, H, D = 2, 2, 16


def _psd(g, n: int, decay: float = 0.7) -> np.ndarray:
    a = g.standard_normal((n, D)) * decay ** np.arange(D)
    q, _ = np.linalg.qr(g.standard_normal((D, D)))
    a = a @ q
    return a.T @ a / n


@pytest.fixture(scope="module")
def stats_and_sensitivity():
    g = np.random.default_rng(0)
    mats = lambda decay: np.stack([np.stack([_psd(g, 200, decay) for _ in range(H)])
                                   for _ in range(L)])
    rows = g.standard_normal((L, H, 300, D)).astype(np.float32) * (0.8 ** np.arange(D)).astype(np.float32)
    stats = AttentionStats(meta={}, q2=mats(0.8), k_mean=g.standard_normal((L, H, D)),
                           k_cov=mats(0.75), v_mean=g.standard_normal((L, H, D)) * 0.1,
                           v_cov=mats(0.8), o_gram=mats(0.9), k_samples=rows, v_samples=rows)
    # A sensitivity far from isotropic, and heads of different weights.
    sens = Sensitivity(meta={}, k=mats(0.6) * np.arange(1, L * H + 1).reshape(L, H, 1, 1),
                       v=mats(0.65))
    return stats, sens


def _recipe(name: str = "calibrated-3bit", **kw) -> recipes.Recipe:
    rec = recipes.load(name)
    return replace(rec, k=replace(rec.k, **kw), v=replace(rec.v, **kw))


def _bits(c) -> np.ndarray:
    """Bits per kept component of one head's codec (from its bands)."""
    return np.concatenate([np.full(w, b) for _, w, b in c.bands]) if c.bands else np.zeros(0)


ROWS = np.random.default_rng(9).standard_normal((64, D)).astype(np.float32)


def _same(a, b) -> bool:
    """Same allocation in every head, and the same reconstruction of the same rows."""
    return all(np.array_equal(_bits(a.codecs[k]), _bits(b.codecs[k]))
               and np.allclose(a.codecs[k].roundtrip(ROWS)[0], b.codecs[k].roundtrip(ROWS)[0],
                               rtol=1e-4, atol=1e-5)
               for k in a.codecs)


def test_allocate_bits_floor_holds_and_is_paid_first() -> None:
    lam = 0.5 ** np.arange(12)
    free = allocate_bits(lam, 24)
    assert free.min() == 0  # weak components get nothing without a floor
    for floor in (1, 2):
        b = allocate_bits(lam, 24, floor=floor)
        assert b.min() >= floor and b.sum() == 24
        assert np.all(np.diff(b) <= 0)
    with pytest.raises(InvalidParameterError, match="floor"):
        allocate_bits(lam, 23, floor=2)
    pooled = global_allocation([lam, lam * 4], [24, 24], floor=1)
    assert all(b.min() >= 1 for b in pooled) and sum(int(b.sum()) for b in pooled) <= 48


def test_min_bits_floor_holds_in_every_head(stats_and_sensitivity) -> None:
    stats, sens = stats_and_sensitivity
    plain = model_codec.ModelCodec(stats, _recipe(), sensitivity=sens)
    # Without a floor some weak components get no bits (they are dropped from the codec).
    assert any(len(_bits(c)) < D for c in plain.codecs.values())
    floored = model_codec.ModelCodec(stats, _recipe(min_bits=1), sensitivity=sens)
    for c in floored.codecs.values():
        assert len(_bits(c)) == D and _bits(c).min() >= 1
    # Same budget: the floor moves bits, it does not add them.
    total = lambda m: sum(int(_bits(c).sum()) for c in m.codecs.values())
    assert total(floored) <= total(plain) + 8 * len(plain.codecs)


def test_floors_per_spectrum_and_per_stream(stats_and_sensitivity) -> None:
    """A floor per spectrum holds where it is set and nowhere else: a pooled allocation over K
    and V with ``min_bits`` on V alone floors V's components only (K's weak ones still get no
    bits), and the per-component floor of ``allocate_bits`` is paid first."""
    lam = 0.5 ** np.arange(12)
    b = allocate_bits(lam, 24, floor=np.array([0] * 6 + [2] * 6))
    assert b[6:].min() >= 2 and b.sum() == 24 and b[:6].min() == 0  # no floor there
    with pytest.raises(InvalidParameterError, match="floor"):
        allocate_bits(lam, 24, floor=np.array([1, 2]))
    with pytest.raises(InvalidParameterError, match="floors"):
        global_allocation([lam, lam], [24, 24], floor=[1])
    weak, strong = lam * 1e-3, lam
    a, c = global_allocation([weak, strong], [24, 24], floor=[0, 1])
    assert c.min() >= 1 and a.min() == 0
    stats, sens = stats_and_sensitivity
    rec = _recipe()
    only_v = replace(rec, v=replace(rec.v, min_bits=1))
    m = model_codec.ModelCodec(stats, only_v, sensitivity=sens)
    for (s, _, _), c in m.codecs.items():
        if s == "v":
            assert len(_bits(c)) == D and _bits(c).min() >= 1
    assert any(len(_bits(c)) < D for (s, _, _), c in m.codecs.items() if s == "k")


def test_allocate_bits_component_cap() -> None:
    """``max_components`` bounds how many components get any bits and spends the same budget
    on the others; a cap at or past the count changes nothing; a floor that needs more
    components than the cap, or a cap below one, is refused."""
    lam = 0.8 ** np.arange(16)
    free = allocate_bits(lam, 40)
    assert np.count_nonzero(free) > 8
    for cap in (1, 4, 8):
        b = allocate_bits(lam, 40, max_components=cap)
        assert np.count_nonzero(b) == cap and b.sum() == min(40, 8 * cap)
        assert np.array_equal(np.flatnonzero(b), np.arange(cap))  # the strongest ones
    assert np.array_equal(allocate_bits(lam, 40, max_components=16), free)
    assert np.array_equal(allocate_bits(lam, 40, max_components=None), free)
    # One cap per segment.
    two = allocate_bits(np.concatenate([lam, lam]), 80, max_components=[3, None],
                        segments=np.repeat([0, 1], 16))
    assert np.count_nonzero(two[:16]) == 3 and np.count_nonzero(two[16:]) > 3 and two.sum() == 80
    with pytest.raises(InvalidParameterError, match="max_components"):
        allocate_bits(lam, 40, floor=1, max_components=8)
    with pytest.raises(InvalidParameterError, match="max_components"):
        allocate_bits(lam, 40, max_components=0)
    with pytest.raises(InvalidParameterError, match="caps"):
        allocate_bits(lam, 40, max_components=[2, 3], segments=np.zeros(16, np.int64))


def test_global_allocation_component_cap_per_spectrum() -> None:
    lam = 0.8 ** np.arange(16)
    free = global_allocation([lam, lam * 2], [40, 40])
    capped = global_allocation([lam, lam * 2], [40, 40], max_components=[5, None])
    assert np.count_nonzero(capped[0]) <= 5 < np.count_nonzero(free[0])
    assert all(int(b.sum()) % 8 == 0 for b in capped)
    assert sum(int(b.sum()) for b in capped) <= 80
    assert [np.array_equal(a, b) for a, b in zip(global_allocation([lam, lam * 2], [40, 40],
                                                                    max_components=16), free)] == [True, True]
    with pytest.raises(InvalidParameterError, match="caps"):
        global_allocation([lam, lam], [24, 24], max_components=[1])


def test_allocate_bits_component_cost() -> None:
    """``component_cost`` charges a component's first bit that many times the water level: 0
    is the allocation without it; a rising cost gives fewer components bits, never more, the
    strongest ones kept, the same budget spent, the loss rising with the cost; bad costs are
    refused."""
    lam = np.sort(np.concatenate([0.8 ** np.arange(24), 0.05 * 0.9 ** np.arange(24)]))[::-1]
    mse = np.asarray(LLOYD_MAX_MSE)
    free = allocate_bits(lam, 96)
    assert np.array_equal(allocate_bits(lam, 96, component_cost=0.0), free)
    assert np.array_equal(allocate_bits(lam, 96, component_cost=np.zeros(48)), free)
    counts, losses = [], []
    for cost in (0.5, 1.0, 2.0, 4.0, 16.0):
        b = allocate_bits(lam, 96, component_cost=cost)
        assert b.sum() == free.sum()
        kept = np.flatnonzero(b)
        assert np.array_equal(kept, np.arange(len(kept)))  # lam is descending
        counts.append(len(kept))
        losses.append(float((lam * mse[b]).sum()))
    assert counts == sorted(counts, reverse=True) and counts[0] < np.count_nonzero(free)
    assert counts[-1] < counts[0]
    assert losses == sorted(losses) and losses[0] > float((lam * mse[free]).sum())
    # One cost per component: only the charged ones lose bits.
    half = allocate_bits(lam, 96, component_cost=np.r_[np.zeros(24), np.full(24, 4.0)])
    assert np.count_nonzero(half[24:]) < np.count_nonzero(free[24:])
    assert np.array_equal(half[:24] > 0, free[:24] > 0)
    # A floor is kept whatever the cost.
    assert allocate_bits(lam, 60, floor=1, component_cost=16.0).min() == 1
    for bad in (-1.0, np.nan, np.inf, np.zeros(3)):
        with pytest.raises(InvalidParameterError, match="component_cost"):
            allocate_bits(lam, 96, component_cost=bad)


def test_global_allocation_component_cost_per_spectrum() -> None:
    """A cost on one spectrum of a pooled allocation: that spectrum's heads keep fewer
    components (none it did not have before the bytes were rounded), the other keeps at least
    as many, rows stay whole bytes within the pooled budget."""
    g = np.random.default_rng(3)
    sps = [np.sort(g.exponential(1.0, 32))[::-1] * 0.85 ** np.arange(32) for _ in range(6)]
    budgets = [64] * 6
    free = global_allocation(sps, budgets)
    costs = [3.0, 3.0, 3.0, 0.0, 0.0, 0.0]
    priced = global_allocation(sps, budgets, component_cost=costs)
    assert all(int(b.sum()) % 8 == 0 for b in priced)
    assert sum(int(b.sum()) for b in priced) <= sum(budgets)
    nz = lambda bs: [int(np.count_nonzero(b)) for b in bs]
    assert sum(nz(priced)[:3]) < sum(nz(free)[:3])
    assert sum(nz(priced)[3:]) >= sum(nz(free)[3:])
    assert [np.array_equal(a, b) for a, b in zip(global_allocation(sps, budgets, component_cost=0.0),
                                                  free)] == [True] * 6
    with pytest.raises(InvalidParameterError, match="component costs"):
        global_allocation(sps, budgets, component_cost=[1.0])


def test_component_cost_lowers_key_components(stats_and_sensitivity) -> None:
    """A recipe's ``component_cost`` on K: fewer key components in all, the values' codecs
    never fewer, in the pooled allocation and the per-head one."""
    stats, sens = stats_and_sensitivity
    rec = _recipe()
    count = lambda m, s: sum(len(_bits(c)) for (t, _, _), c in m.codecs.items() if t == s)
    plain = model_codec.ModelCodec(stats, rec, sensitivity=sens)
    priced = model_codec.ModelCodec(stats, replace(rec, k=replace(rec.k, component_cost=4.0)),
                                    sensitivity=sens)
    assert count(priced, "k") < count(plain, "k") and count(priced, "v") >= count(plain, "v")
    per_head = replace(rec, k=replace(rec.k, allocation="per-head", whiten="none"),
                       v=replace(rec.v, allocation="per-head", whiten="none", min_bits=0))
    a = model_codec.ModelCodec(stats, per_head, sensitivity=sens)
    b = model_codec.ModelCodec(stats, replace(per_head, k=replace(per_head.k, component_cost=4.0)),
                               sensitivity=sens)
    assert count(b, "k") < count(a, "k")


def test_max_components_holds_in_every_head(stats_and_sensitivity) -> None:
    """A recipe's ``max_components`` on K alone: every key codec keeps at most that many
    components, in the pooled allocation and the per-head one, and the pooled bits stay within
    the budget."""
    stats, sens = stats_and_sensitivity
    rec = _recipe()
    plain = model_codec.ModelCodec(stats, rec, sensitivity=sens)
    most = max(len(_bits(c)) for (s, _, _), c in plain.codecs.items() if s == "k")
    cap = most - 3
    capped = model_codec.ModelCodec(stats, replace(rec, k=replace(rec.k, max_components=cap)),
                                    sensitivity=sens)
    assert all(len(_bits(c)) <= cap for (s, _, _), c in capped.codecs.items() if s == "k")
    total = lambda m: sum(int(_bits(c).sum()) for c in m.codecs.values())
    assert total(capped) <= total(plain) + 8 * len(plain.codecs)
    # The per-head allocation takes the cap too.
    per_head = replace(rec, k=replace(rec.k, allocation="per-head", whiten="none", max_components=cap),
                       v=replace(rec.v, allocation="per-head", whiten="none", min_bits=0))
    m = model_codec.ModelCodec(stats, per_head, sensitivity=sens)
    assert all(len(_bits(c)) <= cap for (s, _, _), c in m.codecs.items() if s == "k")


def test_shrink_fisher_endpoints() -> None:
    g = np.random.default_rng(1)
    f = _psd(g, 50, 0.6)
    assert np.array_equal(shrink_fisher(f, 0.0), f)
    np.testing.assert_allclose(shrink_fisher(f, 1.0), np.eye(D) * np.trace(f) / D, rtol=1e-12)
    p = _psd(g, 50, 0.9)
    one = shrink_fisher(f, 1.0, p)
    np.testing.assert_allclose(one, p * np.trace(f) / np.trace(p), rtol=1e-12)
    half = shrink_fisher(f, 0.5, p)
    np.testing.assert_allclose(half, (f + one) / 2, rtol=1e-12)
    assert np.trace(half) == pytest.approx(np.trace(f))  # a head keeps its weight


def test_fisher_shrink_zero_is_the_measurement_alone(stats_and_sensitivity, monkeypatch) -> None:
    stats, sens = stats_and_sensitivity
    rec = _recipe()
    assert rec.k.fisher_shrink == 0.0 and rec.v.fisher_shrink == 0.0  # the shipped default
    now = model_codec.ModelCodec(stats, rec, sensitivity=sens)
    # As before the lever existed: the sensitivity straight to the fit.
    monkeypatch.setattr(model_codec, "shrunk_sensitivity", lambda s, *_: s)
    before = model_codec.ModelCodec(stats, rec, sensitivity=sens)
    assert _same(now, before)


@pytest.mark.parametrize("prior", ["identity", "proxy"])
def test_fisher_shrink_one_is_the_prior_alone(stats_and_sensitivity, prior) -> None:
    stats, sens = stats_and_sensitivity
    shrunk = model_codec.ModelCodec(stats, _recipe(fisher_shrink=1.0, fisher_prior=prior),
                                    sensitivity=sens)
    # The prior, built by hand, handed over as if it had been measured.
    by_hand = {}
    for s, proxy in (("k", stats.q2), ("v", stats.o_gram)):
        f = sens.of(s)
        out = np.empty_like(f)
        for layer in range(L):
            for h in range(H):
                tr = np.trace(f[layer, h])
                p = np.eye(D) if prior == "identity" else proxy[layer, h]
                out[layer, h] = p * tr / np.trace(p)
        by_hand[s] = out
    prior_sens = Sensitivity(meta={}, k=by_hand["k"], v=by_hand["v"])
    assert _same(shrunk, model_codec.ModelCodec(stats, _recipe(), sensitivity=prior_sens))
    # ... and the allocation is not the measured one's, nor is halfway either end.
    measured = model_codec.ModelCodec(stats, _recipe(), sensitivity=sens)
    half = model_codec.ModelCodec(stats, _recipe(fisher_shrink=0.5, fisher_prior=prior),
                                  sensitivity=sens)
    assert not _same(shrunk, measured)
    assert not _same(half, measured) and not _same(half, shrunk)


def test_levers_are_checked() -> None:
    with pytest.raises(InvalidParameterError, match="fisher_shrink"):
        _recipe(fisher_shrink=1.5)
    with pytest.raises(InvalidParameterError, match="fisher_prior"):
        _recipe(fisher_prior="flat")
    with pytest.raises(InvalidParameterError, match="min_bits"):
        _recipe(min_bits=9)
    with pytest.raises(InvalidParameterError, match="max_components"):
        _recipe(max_components=0)
    with pytest.raises((InvalidParameterError, TypeError), match="max_components"):
        _recipe(max_components="all")
    with pytest.raises(InvalidParameterError, match="component_cost"):
        _recipe(component_cost=-0.5)
    with pytest.raises((InvalidParameterError, TypeError), match="component_cost"):
        _recipe(component_cost="high")


def test_per_head_tables_fit_each_heads_own_rows(stats_and_sensitivity) -> None:
    """tables = "per-head": each (layer, kv-head) gets Lloyd-Max tables fitted on its own rows'
    z instead of the stream's pooled rows ("calibrated"): the same bits in every mode, other
    codecs where the heads' rows differ, and the very same codecs as the pooled tables where
    every head has the same rows, statistics and sensitivity (pooling copies changes nothing)."""
    stats, sens = stats_and_sensitivity
    rows = np.array(stats.k_samples, copy=True)
    rows[1, 1] = (np.random.default_rng(3).laplace(size=rows[1, 1].shape)
                  * 0.8 ** np.arange(D)).astype(np.float32)
    mean = rows.mean(axis=2).astype(np.float64)
    centred = rows - mean[:, :, None]
    cov = np.einsum("lhsi,lhsj->lhij", centred, centred) / rows.shape[2]

    def codecs(rows, mean, cov, sens):
        st = replace(stats, k_samples=rows, v_samples=rows, k_mean=mean, v_mean=mean, k_cov=cov,
                     v_cov=cov)
        return {t: model_codec.ModelCodec(st, _recipe(tables=t), sensitivity=sens)
                for t in ("gaussian", "calibrated", "per-head")}

    differ = codecs(rows, mean, cov, sens)
    assert set(differ["calibrated"].tables) == {"k", "v"} and not differ["per-head"].tables
    for key in differ["per-head"].codecs:
        assert np.array_equal(_bits(differ["per-head"].codecs[key]),
                              _bits(differ["gaussian"].codecs[key]))
    assert not _same(differ["per-head"], differ["calibrated"])
    # Every head the same; the rows repeated so that each head alone has enough of every width
    # for its own tables (a width with fewer than 64 * 2**b values keeps the N(0, 1) table).
    one = lambda a: np.broadcast_to(a[:1, :1], a.shape).copy()
    many = np.broadcast_to(np.tile(rows[:1, :1], (1, 1, 64, 1)), (L, H, 64 * rows.shape[2], D))
    alike = codecs(np.ascontiguousarray(many), one(mean), one(cov),
                   Sensitivity(meta={}, k=one(sens.k), v=one(sens.v)))
    assert _same(alike["per-head"], alike["calibrated"])
    assert not _same(alike["per-head"], alike["gaussian"])
    rec = recipes.load("calibrated-3bit")
    with pytest.raises(InvalidParameterError, match="tables"):
        replace(rec.k, tables="per-layer").checked("k")
