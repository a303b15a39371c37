"""Prompt lookup (generate.py --prompt-lookup K) against plain decoding, the default model as users run it (int4 on
the CPU), greedy: each configuration in its own process, decode tok/s from generate.py's stats line.

    python benchmarks/lookup.py [--ks 2,4,8] [--repeat 3] [--device cpu] [--checkpoint DIR] [--json OUT]

Each configuration runs --repeat times, in turn with the others, and its median counts (one run on a 2-core
machine varies by 20% and more). Copy-heavy prompts (fix a paragraph's spelling, add type hints to code, answer
from a quoted passage), where the output repeats the input, and open-ended ones, where it does not.
"""
import argparse
import datetime
import json
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PARAGRAPH = ("Teh history of the lighthouse begins in anceint times, when fires were lit on hilltops to guide "
             "sailors home. Over the centuries these fires becamme towers of stone, and the towers recieved lamps, "
             "lenses and finaly electric lights that could be seen for miles across the dark water.")
CODE = '''def merge_intervals(intervals):
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(intervals):
    total = 0
    for start, end in merge_intervals(intervals):
        total += end - start
    return total


def find_gaps(intervals, lower, upper):
    gaps = []
    cursor = lower
    for start, end in merge_intervals(intervals):
        if start > cursor:
            gaps.append((cursor, min(start, upper)))
        cursor = max(cursor, end)
    if cursor < upper:
        gaps.append((cursor, upper))
    return gaps'''
PASSAGE = ("The Eiffel Tower was built between 1887 and 1889 as the entrance arch to the 1889 World's Fair in Paris. "
           "It was designed by the engineering company of Gustave Eiffel and is 330 metres tall. At first many "
           "artists criticised its design, but it became a global cultural icon of France.")
PROMPTS = {
    "copy: fix spelling": f"Repeat the following paragraph, fixing its spelling:\n\n{PARAGRAPH}",
    "copy: type hints": f"Add type hints to this code and return the whole code:\n\n{CODE}",
    "copy: quoted passage": f"{PASSAGE}\n\nUsing the passage above, who designed the Eiffel Tower, when was it built "
                            "and how tall is it? Quote the passage in your answer.",
    "open: story": "Write a story about a lighthouse keeper who finds a message in a bottle.",
    "open: explain": "Explain to a ten-year-old why the sky is blue and sunsets are red.",
}
STATS = re.compile(r"decode (\d+) tokens in ([\d.]+) s: ([\d.]+) tok/s")
ROUND = re.compile(r"([\d.]+) tokens per round")


def run(prompt: str, k: int, a) -> dict:
    argv = [sys.executable, str(ROOT / "generate.py"), "--prompt", prompt, "--chat", "--temperature", "0",
            "--max-new-tokens", str(a.max_new_tokens), "--device", a.device, "--compile"]
    argv += ["--prompt-lookup", str(k)] if k else []
    argv += ["--checkpoint", str(a.checkpoint)] if a.checkpoint else []
    p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    stats, per_round = STATS.search(p.stderr), ROUND.search(p.stderr)
    if p.returncode or not stats:
        sys.exit(f"error: {' '.join(argv)} failed:\n{p.stderr[-2000:]}")
    return {"k": k, "tokens": int(stats[1]), "tok_s": float(stats[3]),
            "tokens_per_round": float(per_round[1]) if per_round else 1.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ks", default="2,4,8", help="comma-separated K (tokens proposed a round)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--checkpoint", type=Path, help="default: the default model")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--json", type=Path, help="append the records here")
    p.add_argument("--only", default="", help="the prompts whose name contains this")
    p.add_argument("--repeat", type=int, default=3, help="runs of each configuration, in turn: the median counts")
    a = p.parse_args()
    ks = [int(k) for k in a.ks.split(",")]
    print("| prompt | plain tok/s | " + " | ".join(f"K={k}: tok/s, tokens a round, speed-up" for k in ks) + " |")
    print("|---|---|" + "---|" * len(ks))
    records = []
    for name, prompt in [(n, p) for n, p in PROMPTS.items() if a.only in n]:
        for k in [0, *ks]:  # (the first run of a configuration builds its steps ahead of time, once)
            run(prompt, k, a)
        runs = [[run(prompt, k, a) for k in [0, *ks]] for _ in range(a.repeat)]  # (in turn: the machine drifts)
        plain, *rows = [sorted(c, key=lambda r: r["tok_s"])[len(c) // 2] for c in zip(*runs)]  # medians
        for r in [plain, *rows]:
            records.append({"prompt": name, **r, "speedup": r["tok_s"] / plain["tok_s"], "device": a.device,
                            "torch": torch.__version__, "date": str(datetime.date.today()),
                            "command": "python " + " ".join(sys.argv)})
        print(f"| {name} | {plain['tok_s']:.1f} | " + " | ".join(
            f"{r['tok_s']:.1f}, {r['tokens_per_round']:.2f}, {r['tok_s'] / plain['tok_s']:.2f}x" for r in rows) + " |",
            flush=True)
    if a.json:
        old = json.loads(a.json.read_text()) if a.json.exists() else []
        a.json.write_text(json.dumps(old + records, indent=1))


if __name__ == "__main__":
    main()
