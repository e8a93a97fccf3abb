"""The measurement record, generated: rewrites the blocks between

    <!-- generated: bench all (headline) ... -->        (or "(figures)"; no kind means figures)
    <!-- end generated -->

in README.md and docs/performance.md from a `bench all` folder's JSON, so that their tables carry the run's
command, date, machine and commit instead of figures typed by hand. Only the marked blocks change; every
byte outside them stays as it was. `headline`: tokens per second per engine and the ratios; `figures`:
those plus every benchmark's table (report.md's sections) and links to the plots."""
from __future__ import annotations

import os
import re
from pathlib import Path

from bench.report import BODIES, SECTIONS, load_results, step_state

END = "<!-- end generated -->"
BLOCK = re.compile(r"<!-- generated: bench all(?: \((?P<kind>headline|figures)\))?(?:(?!-->).)*-->.*?"
                   + re.escape(END), re.DOTALL)
HEADLINE = ("Tokens per second per engine", "Ratios measured in this run")
PLOTS = {"Tokens per second per engine": "engines.png", "Speculation: tokens per pass vs budget": "tokens_per_pass.png",
         "Streaming: pass time vs tree size": "pass_time.png",
         "Quantization: perplexity vs bits per parameter": "perplexity_bits.png",
         "Batched decoding: throughput vs batch size": "batch_throughput.png",
         "AutoJudge: threshold curve": "judge_threshold.png"}


def source_line(manifest: dict, folder_text: str) -> str:
    m = manifest["machine"]
    return (f"`{manifest['command']}`, {manifest['date']}, {m['cpu']} ({m['cores']} cores, {m['ram_gib']} GiB, "
            f"torch {m['torch']}), commit {manifest.get('commit') or 'unknown'}, "
            f"{manifest['wall_seconds'] / 60:.1f} min")


def render(kind: str, folder: Path, document: Path, folder_text: str) -> str:
    """The block for `document` (its plot links relative to it), markers included."""
    manifest, results = load_results(folder)
    marker = (f"<!-- generated: bench all ({kind}) from {folder_text}; do not edit by hand, rerun "
              f"`specstream bench record --from {folder_text}` -->")
    report = os.path.relpath(folder / "report.md", document.parent)
    parts = [marker, f"Measured by {source_line(manifest, folder_text)}; every table and plot: [report.md]({report})."]
    for heading in HEADLINE if kind == "headline" else tuple(SECTIONS)[:-1]:
        step = SECTIONS[heading]
        body = (step_state(manifest, results, step) if step else None) or BODIES[heading](results, manifest, {})
        if heading == "AutoJudge: threshold curve":
            continue          # not a suite measurement (its own eval files): the docs cite those directly
        picture = folder / PLOTS.get(heading, "-")
        link = f"\n\n![{heading}]({os.path.relpath(picture, document.parent)})" if kind == "figures" and \
            picture.is_file() else ""
        parts.append(f"**{heading}**\n\n{body}{link}")
    return "\n\n".join(parts) + "\n" + END


def rewrite(document: Path, folder: Path, folder_text: str | None = None) -> int:
    """Rewrites every generated block of `document` -> how many; ValueError when it has none."""
    text = document.read_text()
    folder_text = folder_text or _shown(folder)
    count = 0

    def replace(match: re.Match) -> str:
        nonlocal count
        count += 1
        return render(match.group("kind") or "figures", folder, document, folder_text)

    new = BLOCK.sub(replace, text)
    if count == 0:
        raise ValueError(f"{document} has no generated block: add the two lines "
                         f"'<!-- generated: bench all (headline) -->' and '{END}' where the table goes")
    if new != text:
        document.write_text(new)
    return count


def _shown(folder: Path) -> str:
    """The folder as the block names it: relative to the working directory when inside it, else its name."""
    try:
        return str(folder.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return folder.name
