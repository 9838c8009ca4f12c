"""``Rows``, the growable row store under every policy-cache layer: appends and drops in any
pattern keep exactly the rows a plain list would, whichever path a drop takes."""
from __future__ import annotations

import random

import torch

from localctx.kvcache.layer_store import Rows


def test_rows_match_a_list_under_sliding_window_drops_and_arbitrary_ones():
    rng = random.Random(3)
    rows, ref, next_id = Rows((2,), torch.float32, "cpu"), [], 0
    starts_moved = 0
    for step in range(400):
        n_new = rng.choice([1, 1, 1, 5, 17])
        new = torch.arange(next_id, next_id + n_new, dtype=torch.float32)[:, None].repeat(1, 2)
        rows.append(new)
        ref += list(range(next_id, next_id + n_new))
        next_id += n_new
        mask = torch.ones(len(ref), dtype=torch.bool)
        if step % 7 == 6 and len(ref) > 3:  # drop arbitrary rows (heavy hitters kept out of order)
            for i in rng.sample(range(len(ref)), len(ref) // 3):
                mask[i] = False
        elif len(ref) > 40:  # a window: drop the oldest rows after 4 sinks
            mask[4:4 + len(ref) - 40] = False
        before = rows.start
        rows.keep(mask)
        starts_moved += rows.start > before
        ref = [r for r, keep in zip(ref, mask.tolist()) if keep]
        assert rows.n == len(ref)
        assert rows.view[:, 0].tolist() == ref and rows.view[:, 1].tolist() == ref
        assert rows.nbytes == len(ref) * 2 * 4
    assert starts_moved > 100  # the window's drops took the path that moves only the sinks
    assert rows.buf.shape[0] <= 4 * 64  # and the buffer did not grow without bound


def test_drop_run_moves_the_shorter_side_of_the_gap():
    def filled(n):
        rows = Rows((), torch.long, "cpu")
        rows.append(torch.arange(n))
        return rows

    short_head = filled(20)
    short_head.drop_run(3, 5)  # 3 sinks move forward over the 5 dropped rows
    assert short_head.start == 5 and short_head.view.tolist() == [0, 1, 2] + list(range(8, 20))
    long_head = filled(20)
    long_head.drop_run(15, 3)  # the 2 rows after the gap move back instead
    assert long_head.start == 0 and long_head.view.tolist() == list(range(15)) + [18, 19]
    everything = filled(6)
    everything.drop_run(0, 6)
    assert everything.n == 0 and everything.view.numel() == 0


def test_restore_undoes_any_mix_of_appends_drops_and_in_place_adds_exactly():
    """A step's writes (append, window drops that move rows inside the buffer, arbitrary drops,
    mass added in place) are undone to the bit by restore; commit keeps them."""
    rng = random.Random(11)
    rows = Rows((3,), torch.float32, "cpu")
    rows.append(torch.randn(30, 3))
    for step in range(300):
        before, buf_before = rows.view.clone(), rows.buf
        rows.checkpoint()
        for _ in range(rng.choice([1, 2, 3])):
            op = rng.choice(["append", "window", "arbitrary", "add"])
            if op == "append":
                rows.append(torch.randn(rng.choice([1, 1, 9, 40]), 3))
            elif op == "window" and rows.n > 8:
                rows.drop_run(rng.choice([0, 2, 4, rows.n - 3]), rng.randint(1, 3))
            elif op == "arbitrary" and rows.n > 2:
                mask = torch.rand(rows.n) > 0.3
                rows.keep(mask)
            elif op == "add":
                rows.add_(torch.randn(rows.n, 3))
        if step % 3 == 0:
            rows.commit()
            if rows.n > 200:
                rows.keep(torch.arange(rows.n) >= rows.n - 60)
            continue
        rows.restore()
        assert torch.equal(rows.view, before), f"step {step}"
        assert rows.buf is buf_before  # the buffer of the checkpoint, even after a step that grew it
    rows.restore()  # without a checkpoint: nothing happens
    assert rows.n == rows.view.shape[0]
