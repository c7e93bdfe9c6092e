"""The microbenchmarks' plot and Markdown tables, from what `micro.run` measured."""

from __future__ import annotations

from pathlib import Path

from benchmarks.micro_results import MAX_OVER_BOUND, MIN_RESTART_SPEEDUP, MicroResults
from benchmarks.reporting import print_table


def plot(results: MicroResults, path: Path) -> Path:
    """Restore (and save) time vs prompt length, against the sequential read/write of the same bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    for model, rows in results.throughput.items():
        x = [r.tokens for r in rows]
        ax.plot(x, [r.restore_s for r in rows], "o-", label=f"{model}: restore (kvc)")
        ax.plot(x, [r.sequential_read_s for r in rows], "x--", label=f"{model}: sequential read")
        ax.plot(x, [r.save_s for r in rows], "s:", alpha=0.6, label=f"{model}: save (kvc)")
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="seconds (median of 3)")
    ax.set_title("checkpoint restore vs sequential read (page cache dropped)")
    ax.legend(fontsize=7)
    ax = axes[1]
    rows = results.lookup
    ax.plot([r.entries for r in rows], [r.median_ms for r in rows], "o-", label="median")
    ax.plot([r.entries for r in rows], [r.p90_ms for r in rows], "x--", label="p90")
    ax.plot(
        [r.entries for r in rows],
        [r.rescan_ms for r in rows],
        "s:",
        label="directory rescan (every 2 s)",
    )
    ax.axhline(1.0, color="grey", lw=0.8, ls=":", label="1 ms")
    ax.set(xscale="log", yscale="log", xlabel="checkpoint files in the store", ylabel="ms per lookup")
    ax.set_title("scheduler lookup cost")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def tables(results: MicroResults) -> str:
    parts: list[str] = []
    rows = [
        [
            r.model,
            r.tokens,
            r.file_mib,
            r.save_s,
            r.sequential_write_s,
            r.save_over_write_time,
            r.restore_s,
            r.sequential_read_s,
            r.restore_over_read_time,
        ]
        for model_rows in results.throughput.values()
        for r in model_rows
    ]
    if rows:
        parts.append(
            print_table(
                "(a) kvc save/restore vs sequential write/read (page cache dropped, median of 3)",
                [
                    "model",
                    "tokens",
                    "MiB",
                    "save s",
                    "write s",
                    "save/write",
                    "restore s",
                    "read s",
                    "restore/read",
                ],
                rows,
            )
        )
    if results.lookup:
        parts.append(
            print_table(
                "(b) CheckpointStore.lookup",
                [
                    "files",
                    "median ms",
                    "p90 ms",
                    "p99 ms",
                    "p99 CPU ms",
                    "first lookup after open ms",
                    "with periodic rescan, dir unchanged ms",
                    "with rescan after a change ms",
                    "forced full rescan ms",
                ],
                [
                    [
                        r.entries,
                        r.median_ms,
                        r.p90_ms,
                        r.p99_ms,
                        r.p99_cpu_ms,
                        r.first_lookup_ms,
                        r.lookup_unchanged_rescan_ms,
                        r.lookup_after_change_ms,
                        r.rescan_ms,
                    ]
                    for r in results.lookup
                ],
            )
        )
    c = results.restart
    if c:
        parts.append(
            print_table(
                f"(c) restart restore, {c.model}, {c.prompt_tokens} tokens + {c.suffix_tokens}",
                [
                    "cold TTFT s",
                    "restored TTFT s",
                    "speed-up",
                    "read s",
                    "suffix prefill s",
                    "restored/(read+suffix)",
                    f"goal (>= {MIN_RESTART_SPEEDUP:g}x, <= {MAX_OVER_BOUND:g}x) met",
                ],
                [
                    [
                        c.cold.ttft_s,
                        c.restored.ttft_s,
                        c.speedup_vs_cold,
                        c.sequential_read_s,
                        c.restored.suffix_prefill_s,
                        c.restored_over_read_plus_suffix,
                        "yes" if c.met else "no",
                    ]
                ],
            )
        )
    return "\n\n".join(parts)
