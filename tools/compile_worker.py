"""Compile worker of the portability check; start it through ``portability.run_portability_check``.

    TRITON_INTERPRET=0 python -m tools.compile_worker [--package ditron_ep]
        [--path DIR]... [--module NAME_OR_FILE.py]... [--skip MODULE]...
        [--target cuda:90 --target hip:gfx942]... [--json REPORT.json]

Exit status: 0 all compiled, 1 some check failed, 2 the worker itself failed (report has "fatal").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", default="ditron_ep", help="package to scan ('' for none)")
    parser.add_argument("--path", action="append", default=[], help="folder prepended to sys.path")
    parser.add_argument("--module", action="append", default=[], help="extra module name or .py file to scan")
    parser.add_argument("--skip", action="append", default=[], help="module (and sub-modules) not to import")
    parser.add_argument("--target", action="append", default=[], help="backend:arch[:warp_size]")
    parser.add_argument("--json", help="write the report here instead of stdout")
    args = parser.parse_args(argv)
    for path in reversed(args.path):
        sys.path.insert(0, str(Path(path).resolve()))

    from tools import portability

    try:
        if os.environ.get("TRITON_INTERPRET") != "0":
            raise RuntimeError("set TRITON_INTERPRET=0 in the worker's environment: triton.compile cannot "
                               "compile interpreted functions")
        targets = [portability.parse_target(t) for t in args.target] or list(portability.PORTABILITY_TARGETS)
        report = portability.check(args.package, extra_modules=args.module,
                                   skip=[*portability.DEFAULT_SKIP_MODULES, *args.skip], targets=targets)
        failed = bool(report["import_errors"] or report["unregistered"]
                      or not all(r["ok"] for r in report["results"]))
        status = 1 if failed else 0
    except Exception:
        report = {"package": args.package, "fatal": traceback.format_exc()}
        status = 2
    text = json.dumps(report, indent=1, default=repr)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
