"""The round's receipts give the screening distances and Eqn 14's spread of the screened
models that reading every update again would give."""

import threading

import pytest
import torch

from wakefl.sdk.selffl.rules import trace_variance
from wakefl.sdk.selffl.update_screening import apply_scale, delta_norm
from wakefl.server.round_receipts import RoundReceipts, spread_from_sums

D = 70_001  # more than one chunk, not a multiple of it


def _models(n: int, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(D, generator=g)
    drift = 0.01 * torch.randn(D, generator=g)  # every device moves the same way, a little
    return base, [base + drift + 0.003 * (i + 1) * torch.randn(D, generator=g) for i in range(n)]


# (action of each update) -> the spread of the screened models, from the receipts and as
# a trace variance over the models themselves
ROWS = [
    ("keep", "keep"),
    ("keep", "keep", "keep", "keep"),
    ("keep", "clip", "keep", "keep"),
    ("refuse", "keep", "keep", "clip"),
    ("keep", "refuse", "refuse"),  # one kept: no spread
    ("clip", "clip", "keep"),
]


@pytest.mark.parametrize("actions", ROWS)
def test_spread_equals_the_trace_variance_of_the_screened_models(actions: tuple) -> None:
    g, models = _models(len(actions))
    receipts = RoundReceipts(3, g)
    for i, m in enumerate(models):
        assert receipts.note(f"d{i}", m)
    for i, m in enumerate(models):
        assert receipts.sq_distance[f"d{i}"] == pytest.approx(delta_norm(m, g) ** 2, rel=1e-12)
    receipts.seal()
    scales = [0.5 if a == "clip" else 1.0 for a in actions]
    kept = []
    for i, (a, s) in enumerate(zip(actions, scales, strict=True)):
        if a != "refuse":
            kept.append((f"d{i}", s))
    if "refuse" in actions:
        receipts.restart_sum((models[int(d[1:])], s) for d, s in kept)
    else:
        for i, (a, s) in enumerate(zip(actions, scales, strict=True)):
            if a == "clip":
                receipts.take_out(models[i], 1.0 - s)
    want = trace_variance(
        apply_scale(m, g, s)
        for m, a, s in zip(models, actions, scales, strict=True)
        if a != "refuse"
    )
    assert receipts.spread(kept) == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_an_absurd_refused_update_leaves_no_trace_once_the_sum_is_restarted() -> None:
    g, models = _models(3, seed=3)
    evil = torch.full((D,), 3.0e38)
    receipts = RoundReceipts(2, g)
    for i, m in enumerate([*models, evil]):
        receipts.note(f"d{i}", m)
    receipts.seal()
    kept = [(f"d{i}", 1.0) for i in range(3)]
    receipts.restart_sum((m, 1.0) for m in models)
    assert receipts.spread(kept) == pytest.approx(trace_variance(models), rel=1e-6)


def test_after_the_seal_only_include_folds_in_and_once_per_device() -> None:
    g, (a, b, c) = _models(3, seed=1)
    receipts = RoundReceipts(1, g)
    assert receipts.note("a", a)
    assert not receipts.note("a", b)  # a device's second copy is not counted twice
    assert not receipts.note("x", torch.zeros(5))  # another size: nothing folded in
    receipts.seal()
    assert not receipts.note("b", b)
    assert "b" not in receipts.sq_distance
    receipts.include("b", b)  # read from its file at the close
    receipts.include("b", b)
    receipts.include("c", c)
    want = trace_variance([a, b, c])
    assert receipts.spread([("a", 1.0), ("b", 1.0), ("c", 1.0)]) == pytest.approx(want, rel=1e-6)


def test_notes_from_many_threads_add_up() -> None:
    g, models = _models(8, seed=2)
    receipts = RoundReceipts(1, g)
    threads = [
        threading.Thread(target=receipts.note, args=(f"d{i}", m)) for i, m in enumerate(models)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kept = [(f"d{i}", 1.0) for i in range(8)]
    assert receipts.spread(kept) == pytest.approx(trace_variance(models), rel=1e-6)


def test_spread_from_sums_edge_cases() -> None:
    assert spread_from_sums(torch.zeros(3, dtype=torch.float64), []) == 0.0
    assert spread_from_sums(torch.ones(3, dtype=torch.float64), [3.0]) == 0.0
    # two vectors +-1 about the point: mean 0, each squared norm 3 -> variance 3
    assert spread_from_sums(torch.zeros(3, dtype=torch.float64), [3.0, 3.0]) == 3.0
    # rounding never makes a variance negative
    assert spread_from_sums(torch.full((1,), 2.0, dtype=torch.float64), [1.0, 1.0]) == 0.0


def test_a_packed_update_is_noted_as_its_decoded_vector() -> None:
    from wakefl.protocol import update_codec as C

    g, models = _models(4, seed=5)
    base = g + 1e-4  # the devices' base differs a little from the server's global model
    plain, packed = RoundReceipts(1, g), RoundReceipts(1, g)
    for i, m in enumerate(models):
        p = C.encode(m, base, "int8-delta")
        plain.note(f"d{i}", C.decode(p, base))
        assert packed.note_packed(f"d{i}", p, base)
        assert packed.sq_distance[f"d{i}"] == pytest.approx(plain.sq_distance[f"d{i}"], rel=1e-6)
    assert not packed.note_packed("d0", C.encode(models[0], base, "int8-delta"), base)
    kept = [(f"d{i}", 1.0) for i in range(4)]
    assert packed.spread(kept) == pytest.approx(plain.spread(kept), rel=1e-6)
