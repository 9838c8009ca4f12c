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
