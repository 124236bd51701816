"""``python -m paged_video.bench.peers SWEEP.csv``: ours over each peer, side by side.

The ratio table (``bench table``) names the fastest baseline only; a user choosing between
this project and a peer (``sdpa-best``, FlexAttention, SageAttention, FlashAttention-4, gather +
SDPA) wants each one. Per (kernel, block size): each of our launches' time and, per peer that
ran, its time and ``speedup = peer / ours`` (above 1.0x ours is faster); the peers that did
not run, with their one-line reasons, after. CPU figures are printed and marked: no speed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from paged_video.bench.results import Row, headline_ms, is_gpu_row, read_rows, sig3

PEER_ROLES = ("baseline", "best-of")


def peer_lines(rows: Sequence[Row]) -> list[str]:
    """The side-by-side lines of a sweep's rows."""
    ran = [r for r in rows if not r.get("skipped") and r["kernel"] != "ceiling"]
    lines = [] if all(is_gpu_row(r) for r in ran) else ["CPU figures: not a speed"]
    lines.append(
        f"{'kernel':16s} {'block':6s} {'ours':21s} {'ms':8s} {'peer':21s} {'ms':8s} peer/ours"
    )
    cases = dict.fromkeys((r["kernel"], r["block_size"]) for r in ran)
    for kernel, block in cases:
        here = [r for r in ran if (r["kernel"], r["block_size"]) == (kernel, block)]
        ours = [r for r in here if r["role"] == "ours"]
        # sdpa-best stands for the three forced SDPA backends it is the fastest of.
        peers = [r for r in here if r["role"] in PEER_ROLES and not _sdpa_backend(r)]
        for mine in ours:
            for peer in peers:
                ratio = headline_ms(peer) / headline_ms(mine)
                lines.append(
                    f"{kernel:16s} {block!s:6s} {mine['provider']:21s} "
                    f"{sig3(headline_ms(mine)):8s} {peer['provider']:21s} "
                    f"{sig3(headline_ms(peer)):8s} {sig3(ratio)}x"
                )
    skipped = dict.fromkeys(
        f"not run: {r['kernel']}/{r['provider']}: {r['skipped']}"
        for r in rows
        if r.get("skipped") and r["role"] in PEER_ROLES
    )
    return [*lines, *skipped]


def _sdpa_backend(row: Row) -> bool:
    return row["provider"].startswith("sdpa-") and row["provider"] != "sdpa-best"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m paged_video.bench.peers SWEEP.csv", file=sys.stderr)
        return 2
    try:
        rows = read_rows(args[0], skipped=True)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print("\n".join(peer_lines(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
