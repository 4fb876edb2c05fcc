"""A stand-in for ``python -m pip`` that parses ``download`` like a given pip version does.

    python fake_pip.py --as 23.0.1 --serve DIR [pip arguments...]

pip parses its options with ``optparse``; so does this fake, with the same choices per version, so a
rejected option gets pip's own words and exit status (``option --progress-bar: invalid choice: 'raw'
(choose from 'on', 'off')``, exit 2). ``download`` copies ``DIR/<name>`` for each requirement into
``-d`` (an sdist when the name is in ``--no-binary``, a wheel otherwise, like pip), prints the lines
pip prints, and appends its argv to ``DIR/calls.jsonl`` so a test can see what it was asked.
``--no-binary :all:`` makes it "compile" the sdist's build dependencies, as the real pip would.
"""

from __future__ import annotations

import json
import optparse
import shutil
import sys
from pathlib import Path


class _PipParser(optparse.OptionParser):
    def error(self, msg: str) -> None:  # type: ignore[override]
        # pip's own format: the usage, a blank line, the message; exit 2.
        self.print_usage(sys.stderr)
        print(f"\n{msg}", file=sys.stderr)
        sys.exit(2)


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def main(argv: list[str]) -> int:
    assert argv[0] == "--as" and argv[2] == "--serve", argv
    version, serve, rest = argv[1], Path(argv[3]), argv[4:]
    with (serve / "calls.jsonl").open("a") as fh:
        fh.write(json.dumps(rest) + "\n")
    if rest == ["--version"]:
        print(f"pip {version} from {Path(__file__).parent} (python 3.11)")
        return 0
    if not rest or rest[0] != "download":
        print(f"ERROR: unknown command {rest[:1]}", file=sys.stderr)
        return 1
    parser = _PipParser(usage="\n  pip download [options] <requirement specifier> ...")
    choices = ["on", "off", "raw"] if _version(version) >= (24, 1) else ["on", "off"]
    parser.add_option("--no-deps", action="store_true")
    parser.add_option("--disable-pip-version-check", action="store_true")
    parser.add_option("--no-build-isolation", action="store_true")
    parser.add_option("--progress-bar", choices=choices, default="on")
    parser.add_option("-d", "--dest", dest="dest")
    parser.add_option("--no-binary", action="append", default=[])
    opts, reqs = parser.parse_args(rest[1:])  # exits 2 with optparse's message, as pip does
    no_binary = {n for value in opts.no_binary for n in value.split(",")}
    dest = Path(opts.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for req in reqs:
        name, _, ver = req.partition("==")
        source = serve / name
        if not source.is_file():
            print(f"ERROR: No matching distribution found for {req}")
            return 1
        as_sdist = name in no_binary or ":all:" in no_binary
        filename = f"{name}-{ver}.tar.gz" if as_sdist else f"{name}-{ver}-py3-none-any.whl"
        print(f"Collecting {req}")
        print(f"  Downloading {filename} ({source.stat().st_size} bytes)")
        if opts.progress_bar == "raw":
            size = source.stat().st_size
            print(f"Progress {size // 2} of {size}")
            print(f"Progress {size} of {size}")
        shutil.copyfile(source, dest / filename)
        if as_sdist:
            print("  Installing build dependencies: started")
            if ":all:" in no_binary:
                print("  Building wheel for ninja (pyproject.toml): started")
            print("  Installing build dependencies: finished with status 'done'")
            print("  Preparing metadata (pyproject.toml): finished with status 'done'")
        print(f"Saved {dest / filename}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
