"""RoPE rows from the per-model table (``RopeTable``) are the bits ``rope_cos_sin`` computes for the same positions,
for any set of positions and across the table's growth."""

import torch

from kvserve.layers.rotary import RopeTable, rope_cos_sin, rope_inv_freq


def test_table_rows_equal_direct_computation_bit_for_bit():
    inv = rope_inv_freq(64, 100000.0)
    table = RopeTable(inv, torch.float32)
    g = torch.Generator().manual_seed(0)
    sizes = []
    for t, end in ((1, 1), (5, 40), (17, 300), (64, 3000), (3, 9000), (300, 9000)):
        pos = torch.randint(0, end, (t,), generator=g)
        pos[0] = end - 1  # the last position below end
        cos, sin = table(pos, end)
        ref_cos, ref_sin = rope_cos_sin(pos, inv, torch.float32)
        assert cos.shape == sin.shape == (t, 1, 64) and cos.is_contiguous() and sin.is_contiguous()
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
        sizes.append(table.cos.shape[0])
    assert sizes == [256, 256, 512, 3000, 9000, 9000]  # grows by doubling, or to what a step needs
