"""Write the figures of a scripts/gpu_check.sh run into the GPU results page's block (docs/results/gpu-h200.md).

Usage:
    python scripts/gpu_figures.py OUT_DIR [--page docs/results/gpu-h200.md]

OUT_DIR is the folder gpu_check.sh wrote (the device tool's $OUT, copied back). The block between
``<!-- gpu-figures:start -->`` and ``<!-- gpu-figures:end -->`` in the README is replaced with: the
device and versions, the outcome of every step, the `gpu` tests' summary line and the two speed-up
tables (SmolLM2-135M's and Llama-3-8B's shapes). Running it again on the same folder gives the same
README. Nothing is invented: a missing file or step is written as missing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

START, END = "<!-- gpu-figures:start -->", "<!-- gpu-figures:end -->"
TABLES = (("kernel_smollm2", "SmolLM2-135M (the demo model)"), ("kernel_llama8b", "Llama-3-8B"))


def _device_line(out: Path) -> str:
    for stem, _ in TABLES:
        path = out / f"{stem}.json"
        if path.is_file():
            dev = json.loads(path.read_text())["device"]
            mem = f", {dev['memory_bytes'] / 2**30:.0f} GiB" if dev.get("memory_bytes") else ""
            cuda = f", CUDA {dev['cuda_version']}" if dev.get("cuda_version") else ""
            return f"{dev['name']} ({dev['device_class']}{mem}), torch {dev['torch_version']}{cuda}"
    return "device unknown: no kernel_*.json in the run's folder"


def _steps(out: Path) -> list[str]:
    path = out / "summary.txt"
    if not path.is_file():
        return ["no summary.txt: the run did not finish"]
    lines = []
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(": rc=")
        if rest:
            rc, _, took = rest.partition(" in ")
            lines.append(f"{name} {'ok' if rc == '0' else f'FAILED (exit {rc})'} ({took})")
    return lines


def _pytest_summary(out: Path) -> str:
    log = out / "gpu_check.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    # the step's own output: from its header line to its "gpu-tests: rc=" line (pytest prints ===== lines too)
    match = re.search(r"^===== gpu-tests:.*?$(.*?)^gpu-tests: rc=", text, flags=re.MULTILINE | re.DOTALL)
    section = match.group(1) if match else ""
    found = re.findall(r"^\s*=*\s*(\d+ (?:passed|failed|skipped|deselected|error)[^=\n]*?)\s*=*\s*$", section,
                       flags=re.MULTILINE)
    return found[-1] if found else "no pytest summary in gpu_check.log"


def _baseline_dtype(path: Path) -> str:
    """The baseline GEMM's dtype of a run (quantcore.kernels.bench: bf16 on CUDA, fp32 on a CPU dry run)."""
    if not path.is_file():
        return "the baseline"
    return "bf16" if json.loads(path.read_text())["device"]["kind"] == "cuda" else "fp32"


def figures_block(out: Path) -> str:
    parts = [
        START,
        f"Measured by `scripts/gpu_check.sh` on {_device_line(out)}.",
        "",
        f"- `pytest -m gpu`: {_pytest_summary(out)}",
        "- steps: " + "; ".join(_steps(out)),
    ]
    for stem, label in TABLES:
        md = out / f"{stem}.md"
        parts += ["", f"**{label}**: speed-up over {_baseline_dtype(out / f'{stem}.json')} · percent of the dense "
                  "peak for the path's dtype (speed-ups: medians of calls timed interleaved with the baseline's; "
                  "\"(unstable)\": the p20-p80 band of the case's calls is wider than a quarter of its median)", ""]
        parts.append(md.read_text().strip() if md.is_file() else f"({md.name} missing: that step did not finish)")
    parts.append(END)
    return "\n".join(parts)


def update_readme(readme: Path, out: Path) -> None:
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme} has no {START} ... {END} block to fill")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(head + figures_block(out) + tail)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the folder gpu_check.sh wrote")
    ap.add_argument("--page", "--readme", dest="readme", type=Path,
                    default=Path(__file__).resolve().parents[1] / "docs" / "results" / "gpu-h200.md")
    args = ap.parse_args(argv)
    if not args.out.is_dir():
        print(f"gpu_figures: {args.out} is not a folder", file=sys.stderr)
        return 2
    update_readme(args.readme, args.out)
    print(f"gpu_figures: wrote the figures of {args.out} into {args.readme}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
