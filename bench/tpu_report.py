"""One compiled TPU program's figures, per chip, as bench.tpu_aot reports them.

Owns: `Counted` (a compiled step's bytes and FLOPs as bench.tpu_aot counts them),
`Program` (what a program moves, computes and takes against its unavoidable work,
summed over a prompt's chunks) and `summary`, its one line on stderr.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.tpu_roofline import Peaks, Work, ratio

GIB = 1 << 30
NOTHING = Work(0.0, 0.0)


@dataclass(frozen=True)
class Counted:
    """One step's bytes and FLOPs on a chip (`work`); with memory-space assignment on,
    `work`'s bytes are HBM's alone: XLA's own count of every memory space (`xla_bytes`)
    less what it counts of arrays outside HBM (`on_chip_bytes`)."""

    work: Work
    xla_bytes: float | None = None
    on_chip_bytes: float | None = None
    untaken: Work = NOTHING  # of `work`: the logit-bias and allowed-token branches'

    def plus(self, other: Work) -> Counted:
        """With `other`'s work added (the attention kernel's, which XLA cannot see)."""

        xla = None if self.xla_bytes is None else self.xla_bytes + other.bytes
        return Counted(self.work + other, xla, self.on_chip_bytes, self.untaken)


@dataclass
class Program:
    """One program's figures per chip; a prompt's chunks add theirs in turn."""

    name: str
    kind: str
    batch: int
    tokens: int
    sampling: str | None = "greedy"  # the batch's rows: "greedy" or "sampled"
    contexts: str = "full"  # "full": every sequence as long as the pages allow; "mixed"
    kv_positions: int = 0  # positions the batch attends over, summed over its sequences
    compiled: bool = False
    error: str | None = None
    compile_s: float = 0.0
    peak_bytes_per_chip: int = 0
    hbm_bytes_per_chip: int = 0
    bytes_accessed: float = 0.0  # HBM traffic: XLA's count + the kernel's
    unavoidable_bytes: float = 0.0
    ratio: float | None = None
    flops: float = 0.0  # XLA's count + the kernel's
    unavoidable_flops: float = 0.0
    roofline_s: float = 0.0
    unavoidable_roofline_s: float = 0.0
    time_ratio: float | None = None
    bound: str | None = None  # "hbm" or "flops": which term sets roofline_s
    kernel_flops: float = 0.0  # the attention kernel's share of flops
    attention_flops_ratio: float | None = None  # kernel_flops over causal attention's
    # a prompt against one pass over the weights for the whole prompt (prefill only)
    once_unavoidable_bytes: float | None = None
    once_roofline_s: float | None = None
    once_time_ratio: float | None = None
    # memory-space assignment on (bytes_accessed: HBM's alone): XLA's count of every
    # memory space (with the kernel's), and what of it lives outside HBM
    xla_bytes_accessed: float | None = None
    on_chip_bytes: float | None = None
    # the logit-bias and allowed-token branches, which XLA counts in every step's figure,
    # and the figures of a batch that takes neither (bytes, FLOPs, roofline, ratios)
    bias_mask_bytes: float = 0.0
    bias_mask_flops: float = 0.0
    plain_bytes_accessed: float = 0.0
    plain_flops: float = 0.0
    plain_roofline_s: float = 0.0
    plain_time_ratio: float | None = None
    plain_bound: str | None = None
    plain_once_time_ratio: float | None = None

    def add(self, step: Counted, unavoidable: Work, peaks: Peaks) -> None:
        """One step (a prompt's chunk) more."""
        work, untaken = step.work, step.untaken
        self.bytes_accessed += work.bytes
        self.flops += work.flops
        if step.xla_bytes is not None:
            self.xla_bytes_accessed = (self.xla_bytes_accessed or 0.0) + step.xla_bytes
        if step.on_chip_bytes is not None:
            self.on_chip_bytes = (self.on_chip_bytes or 0.0) + step.on_chip_bytes
        self.unavoidable_bytes += unavoidable.bytes
        self.unavoidable_flops += unavoidable.flops
        self.roofline_s += work.seconds(peaks)
        self.unavoidable_roofline_s += unavoidable.seconds(peaks)
        self.ratio = ratio(self.bytes_accessed, self.unavoidable_bytes)
        self.time_ratio = ratio(self.roofline_s, self.unavoidable_roofline_s)
        self.bound = Work(self.bytes_accessed, self.flops).bound(peaks)
        plain = Work(work.bytes - untaken.bytes, work.flops - untaken.flops)
        self.bias_mask_bytes += untaken.bytes
        self.bias_mask_flops += untaken.flops
        self.plain_bytes_accessed += plain.bytes
        self.plain_flops += plain.flops
        self.plain_roofline_s += plain.seconds(peaks)
        self.plain_time_ratio = ratio(self.plain_roofline_s, self.unavoidable_roofline_s)
        self.plain_bound = Work(self.plain_bytes_accessed, self.plain_flops).bound(peaks)

    def once(self, weights: float, chunks: int, peaks: Peaks) -> None:
        """Against the weights read once for the whole prompt (each of its chunks reads
        them) plus the prompt's K/V, the same useful FLOPs."""
        self.once_unavoidable_bytes = self.unavoidable_bytes - weights * (chunks - 1)
        once = Work(self.once_unavoidable_bytes, self.unavoidable_flops)
        self.once_roofline_s = once.seconds(peaks)
        self.once_time_ratio = ratio(self.roofline_s, self.once_roofline_s)
        self.plain_once_time_ratio = ratio(self.plain_roofline_s, self.once_roofline_s)


def summary(p: Program) -> str:
    """One line of a program's figures."""

    def x(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}x"

    once = "" if p.once_time_ratio is None else f"  once {x(p.once_time_ratio)}"
    if p.bias_mask_bytes:
        once += f"  plain {x(p.plain_time_ratio)}"
    if p.xla_bytes_accessed is not None:
        once += f"  xla {p.xla_bytes_accessed / 1e9:.2f} GB"
    return (
        f"{p.name:>20} {p.sampling or '-':>7} {p.contexts:>5} compiled={p.compiled} "
        f"{p.bytes_accessed / 1e9:8.2f} / {p.unavoidable_bytes / 1e9:7.2f} GB = {x(p.ratio)}  "
        f"{p.flops / 1e12:7.3f} / {p.unavoidable_flops / 1e12:7.3f} TFLOP  "
        f"{p.roofline_s * 1e3:8.3f} / {p.unavoidable_roofline_s * 1e3:8.3f} ms = "
        f"{x(p.time_ratio)} {p.bound or '-':>5}{once}  peak "
        f"{p.peak_bytes_per_chip / GIB:.2f} GiB  {p.compile_s:.1f} s"
        + (f"  ERROR {p.error}" if p.error else "")
    )
