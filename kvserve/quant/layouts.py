"""The packed kernel layouts' geometry, one record each, shared by Python and C.

A layout is how ``kvserve/kernels/csrc/qgemm.c`` reads a weight: output features in groups of ``G = 16``, each
group's blocks of ``QK = 32`` inputs contiguous (``pack.py`` writes them, ``kvserve.quant.traits`` maps each GGUF
type to one). A ``Layout`` names its qgemm.c format id, its bytes per 16 x 32 block and the byte offset of each part
of a block (``offsets``), so no byte offset is written out twice: ``pack.py`` and the unpackers read them from here,
and the C header ``csrc/qgemm_layouts.h`` is generated from the same records (``render_c_header``; regenerate it
with ``python -m kvserve.quant.layouts``). At load, ``kernels.qgemm.load`` compares every constant the compiled
library reports (``kvserve_q_layout``) with ``c_constants()`` and refuses a library that disagrees; a test checks
that the committed header is what ``render_c_header`` writes.

This follows ggml's per-type traits (``ggml.c`` ``type_traits``: block size, type size, to/from float per type),
with the kernel layout as its own record, since several GGUF types share one layout.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

QK, G = 32, 16


@dataclass(frozen=True)
class Layout:
    """One packed layout of qgemm.c.

    Attributes:
        name: its C name stem (``FMT_<name>``, ``<name>_BLOCK``, ``<name>_<OFFSET>``).
        fmt: qgemm.c's format id.
        block_bytes: bytes of one block of 16 outputs x 32 inputs (for a layout in super-blocks: on average, so a
            group of ``nb`` blocks is ``nb * block_bytes`` bytes).
        offsets: named byte offsets of a block's parts (in a super-block layout: of the parts of one of its blocks).
        k_multiple: ``K`` (inputs) must be a multiple of this.
        super_offsets: a super-block layout's header offsets (``{}`` for plain blocks).
        super_bytes: bytes of a super-block (``0`` for plain blocks).
        doc: what the layout holds (the full description is at the top of qgemm.c).
    """

    name: str
    fmt: int
    block_bytes: int
    offsets: dict = field(default_factory=dict)
    k_multiple: int = QK
    super_offsets: dict = field(default_factory=dict)
    super_bytes: int = 0
    doc: str = ""

    def off(self, part: str) -> int:
        """The byte offset of ``part`` in a block (KeyError naming the layout for an unknown part)."""
        try:
            return self.offsets[part]
        except KeyError:
            raise KeyError(f"layout {self.name} has no part {part!r}; parts: {sorted(self.offsets)}") from None


#: Every layout, by qgemm.c format id.
Q4 = Layout("Q4", 0, 320, {"D": 0, "M": 32, "QS": 64}, doc="fp16 d[16], fp16 m[16], 256 bytes of nibbles")
Q8 = Layout("Q8", 1, 544, {"D": 0, "QS": 32}, doc="fp16 d[16], 512 int8")
Q4F = Layout("Q4F", 2, 384, {"D": 0, "M": 64, "QS": 128}, doc="float32 d[16], m[16], 256 bytes of nibbles")
Q6 = Layout("Q6", 3, 448, {"D": 0, "SC_LO": 32, "SC_HI": 48, "QL": 64, "QH": 320},
            doc="fp16 d[16], int8 sc_lo[16], sc_hi[16], 256 bytes of low nibbles, 128 of high 2-bit fields")
Q5F = Layout("Q5F", 4, 448, {"D": 0, "M": 64, "QS": 128, "QH": 384}, doc="a Q4F block, then 64 bytes of fifth bits")
Q4K = Layout("Q4K", 5, 296, {"SC": 0, "MN": 16, "QS": 32}, k_multiple=256,
             super_offsets={"D": 0, "DMIN": 32, "BLOCKS": 64}, super_bytes=64 + 8 * 288,
             doc="per 8 blocks fp16 d[16], dmin[16]; per block (288 bytes) uint8 sc[16], mn[16], 256 bytes of nibbles")
MX4 = Layout("MX4", 6, 272, {"E": 0, "QS": 16},
             doc="uint8 E8M0 exponent e[16], 256 bytes of 4-bit E2M1 codes (w = kvalues[code] * 2^(e - 128))")
Q2K = Layout("Q2K", 7, 168, {"SCMN": 0, "QS": 32}, k_multiple=256,
             super_offsets={"D": 0, "DMIN": 32, "BLOCKS": 64}, super_bytes=64 + 8 * 160,
             doc="per 8 blocks fp16 d[16], dmin[16]; per block (160 bytes) uint8 sc | mn << 4 [2][16] (per 16 inputs), "
                 "128 bytes of 2-bit values as Q6's high fields")
Q3K = Layout("Q3K", 8, 228, {"SC": 0, "QS": 32, "QH": 160}, k_multiple=256,
             super_offsets={"D": 0, "BLOCKS": 32}, super_bytes=32 + 8 * 224,
             doc="per 8 blocks fp16 d[16]; per block (224 bytes) int8 sc[2][16] (per 16 inputs), 128 bytes of low 2-bit "
                 "fields as Q2K's, 64 bytes of third bits as Q5F's fifth bits (w = d sc (q - 4), q in 0..7)")
LAYOUTS = {lay.fmt: lay for lay in (Q4, Q8, Q4F, Q6, Q5F, Q4K, MX4, Q2K, Q3K)}
#: A Q4K, Q2K and Q3K block (inside their super-blocks).
Q4K_BLOCK, Q2K_BLOCK, Q3K_BLOCK = 288, 160, 224


def c_constants() -> list[tuple[str, int]]:
    """``[(C name, value)]`` in the order ``kvserve_q_layout`` reports them: ``QK``, ``G``, then per layout its id,
    block bytes, offsets (and a super-block layout's super-block bytes and header offsets)."""
    out = [("QK", QK), ("G", G), ("Q4K_BLOCK", Q4K_BLOCK), ("Q2K_BLOCK", Q2K_BLOCK), ("Q3K_BLOCK", Q3K_BLOCK)]
    for lay in LAYOUTS.values():
        out += [(f"FMT_{lay.name}", lay.fmt), (f"{lay.name}_BLOCK" if not lay.super_bytes else f"{lay.name}_AVG_BLOCK",
                                                lay.block_bytes)]
        out += [(f"{lay.name}_{k}", v) for k, v in lay.offsets.items()]
        if lay.super_bytes:
            out += [(f"{lay.name}_SUPER", lay.super_bytes)]
            out += [(f"{lay.name}_SB_{k}", v) for k, v in lay.super_offsets.items()]
    return out


def render_c_header() -> str:
    """The text of ``csrc/qgemm_layouts.h``: a ``#define`` per ``c_constants`` entry (``FMT_*`` as an enum) and
    ``KVSERVE_Q_LAYOUT`` (their values, in order, for ``kvserve_q_layout``)."""
    consts = c_constants()
    lines = ["/* The packed layouts' constants, generated from kvserve/quant/layouts.py by `python -m",
             " * kvserve.quant.layouts`: do not edit by hand (a test compares this file with the generator's",
             " * output, and kvserve/kernels/qgemm.py compares the compiled values with the Python records at load). */",
             "#ifndef KVSERVE_QGEMM_LAYOUTS_H", "#define KVSERVE_QGEMM_LAYOUTS_H", ""]
    lines += [f"#define QK {QK}", f"#define G {G}"]
    lines.append("enum { " + ", ".join(f"{n} = {v}" for n, v in consts if n.startswith("FMT_")) + " };")
    for lay in LAYOUTS.values():
        lines.append(f"/* {lay.name}: {lay.doc} */")
        for n, v in consts:
            if not n.startswith("FMT_") and (n.startswith(lay.name + "_")):
                lines.append(f"#define {n} {v}")
    lines += ["", f"#define KVSERVE_Q_LAYOUT_N {len(consts)}",
              "#define KVSERVE_Q_LAYOUT {" + ", ".join(n for n, _ in consts) + "}", "", "#endif", ""]
    return "\n".join(lines)


HEADER_PATH = Path(__file__).resolve().parents[1] / "kernels" / "csrc" / "qgemm_layouts.h"

if __name__ == "__main__":  # regenerate the C header
    HEADER_PATH.write_text(render_c_header())
    sys.stdout.write(f"wrote {HEADER_PATH}\n")
