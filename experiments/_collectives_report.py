"""bench_collectives.py's figures and their output: the alpha-beta link fitted to the
baseline's medians, bandwidths and model times per row, the rich table, the markdown
tables and the bus-bandwidth plot (see bench_collectives.py's docstring for the method).
"""

from __future__ import annotations

import os

import _bench

KIB = 1024
MIB = 1024 * 1024


def baseline_label(primitive: str) -> str:
    return "psum (XLA all-reduce)" if primitive == "allreduce" else "XLA all-to-all"


def fmt_size(nbytes: int) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


# ---------------------------------------------------------------------------------------
# The link and the model


def fit_link(rows, n, args):
    """(Link, how) from the flags, or fitted to psum's medians (see bench_collectives.py's docstring)."""
    import numpy as np

    from dpjax.collectives import cost

    if args.latency_us is not None:
        return (cost.Link(args.latency_us * 1e-6, args.bandwidth_gbps * 1e9),
                "given by --latency-us / --bandwidth-gbps")
    pts = sorted((r["size_bytes"], r["time_s"]) for r in rows if r["algorithm"] == "psum")
    t = np.array([p[1] for p in pts])
    b = np.array([cost.bus_factor(args.primitive, n) * p[0] for p in pts])
    if len(pts) < 2:
        return cost.Link(float(t[0]), float("inf")), f"psum at {fmt_size(pts[0][0])} taken as pure latency"
    # alpha + b * beta = t, least squares on the relative error (each row divided by t),
    # so 4 KiB and 64 MiB weigh alike; alpha is kept >= 0 and beta > 0.
    (alpha, beta), *_ = np.linalg.lstsq(np.stack([1 / t, b / t], axis=1), np.ones_like(t), rcond=None)
    if alpha < 0:
        alpha, beta = 0.0, float(np.sum(b / t) / np.sum((b / t) ** 2))
    beta = max(beta, 1e-15)
    return cost.Link(float(alpha), float(1 / beta)), (
        f"fitted to {baseline_label(args.primitive)}: t = alpha + "
        f"{'2(n-1)/n' if args.primitive == 'allreduce' else '(n-1)/n'} * N / bandwidth, least squares on the relative "
        f"error over {fmt_size(pts[0][0])} .. {fmt_size(pts[-1][0])}")


def finish_rows(rows, n, link, primitive="allreduce"):
    from dpjax.collectives import cost

    for r in rows:
        algbw = r["size_bytes"] / r["time_s"]
        r["algbw_GBps"] = algbw / 1e9
        r["busbw_GBps"] = algbw * cost.bus_factor(primitive, n) / 1e9
        r["model_time_s"] = model_time(r, link)
    return rows


def model_time(r, link):
    from dpjax.collectives import cost

    s = cost.Schedule(r["model_steps"], r["model_bytes"])
    return s.time(link)


# ---------------------------------------------------------------------------------------
# Output


COLUMNS = ("size", "algorithm", "median ms", "x psum", "floor x psum", "busbw GB/s",
           "model ms", "model x psum", "steps", "bytes/bound")


def columns(info) -> list[str]:
    """COLUMNS, with the baseline named: psum, or XLA's all-to-all."""
    return [c.replace("psum", "psum" if info["primitive"] == "allreduce" else "XLA") for c in COLUMNS]


def cells(r, model_psum):
    floor = "" if r["floor_ratio"] is None else f"{r['floor_ratio']:.2f}"
    flag = "" if r["correct"] in (None, True) else " WRONG"
    flag += " MISMATCH" if r["mismatch"] else ""
    return (fmt_size(r["size_bytes"]), r["label"] + flag, f"{r['time_s'] * 1e3:.3f}",
            f"{r['ratio']:.2f}", floor, f"{r['busbw_GBps']:.2f}",
            f"{r['model_time_s'] * 1e3:.3f}", f"{r['model_time_s'] / model_psum:.2f}",
            str(r["steps"]), f"{r['bytes_over_bound']:.2f}")


def model_psum_of(rows):
    return {r["size_bytes"]: r["model_time_s"] for r in rows if r["algorithm"] == "psum"}


def print_table(rows, info):
    mp = model_psum_of(rows)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is a dependency, but a plain table is fine too
        print(" | ".join(COLUMNS))
        for r in rows:
            print(" | ".join(cells(r, mp[r["size_bytes"]])))
        return
    t = Table(title=f"{info['primitive']} on {info['n']} {info['platform']} devices, float32 "
                    f"(link: alpha {info['alpha_us']:.1f} us, {info['bandwidth_GBps']:.2f} GB/s, "
                    f"{info['link_how']})")
    for c in columns(info):
        t.add_column(c, justify="left" if c in ("size", "algorithm") else "right")
    last = None
    for r in rows:
        if last is not None and r["size_bytes"] != last:
            t.add_section()
        last = r["size_bytes"]
        t.add_row(*cells(r, mp[r["size_bytes"]]))
    Console(width=160).print(t)


def markdown(rows, info, argv) -> str:
    mp = model_psum_of(rows)
    algs = [r["algorithm"] for r in rows if r["size_bytes"] == rows[0]["size_bytes"]]
    labels = {r["algorithm"]: r["label"] for r in rows}
    out = [f"Command: `python experiments/bench_collectives.py {' '.join(argv)}`".rstrip(),
           "",
           f"{info['n']} {info['platform']} devices ({info['machine']}"
           + (f"; {info['processes']} processes joined by jax.distributed" if info["processes"] > 1 else "")
           + f"), jax {info['jax']}, "
           f"float32, median of {info['reps']} interleaved repetitions; link "
           f"alpha = {info['alpha_us']:.1f} us, bandwidth = {info['bandwidth_GBps']:.2f} GB/s "
           f"({info['link_how']}).",
           "",
           f"Time relative to {info['baseline']} (median of back-to-back ratios; lower is better):",
           "",
           "| size | " + " | ".join(labels[a] for a in algs) + " |",
           "|---" * (len(algs) + 1) + "|"]
    for size in sorted({r["size_bytes"] for r in rows}):
        by = {r["algorithm"]: r for r in rows if r["size_bytes"] == size}
        out.append(f"| {fmt_size(size)} | " + " | ".join(
            f"{by[a]['ratio']:.2f}" if a in by else "" for a in algs) + " |")
    out += ["", "All figures:", "",
            "| " + " | ".join(columns(info)) + " |", "|---" * len(COLUMNS) + "|"]
    out += ["| " + " | ".join(cells(r, mp[r["size_bytes"]])) + " |" for r in rows]
    return "\n".join(out) + "\n"


def plot(rows, info, path):
    plt = _bench.pyplot(path)
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    algs = list(dict.fromkeys(r["algorithm"] for r in rows))
    for a in algs:
        pts = sorted((r["size_bytes"], r["busbw_GBps"], r["label"]) for r in rows if r["algorithm"] == a)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                linewidth=2.5 if a == "psum" else 1.5, color="black" if a == "psum" else None,
                label=pts[0][2])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({r["size_bytes"] for r in rows})
    ax.set_xticks(ticks, [fmt_size(s).replace(" ", "") for s in ticks])
    ax.set_xlabel("message size per device")
    ax.set_ylabel("bus bandwidth (GB/s), nccl-tests definition")
    ax.set_title(f"{info['primitive']}, {info['n']} {info['platform']} devices, float32 "
                 f"(median of {info['reps']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
