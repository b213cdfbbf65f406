"""``python -m omniwire.integrations.sglang_omni install-pth | uninstall-pth | check``."""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

from ._autoload import PTH_LINE, PTH_NAME


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m omniwire.integrations.sglang_omni")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (
        (
            "install-pth",
            "write the .pth hook: OMNIWIRE_SGLANG_OMNI=1 then enables omniwire in every stage",
        ),
        ("uninstall-pth", "remove the .pth hook"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument(
            "--site", default=sysconfig.get_paths()["purelib"], help="site-packages directory"
        )
    sub.add_parser(
        "check", help="check the installed sglang-omni against what the adapter relies on"
    )
    args = ap.parse_args(argv)
    if args.cmd == "check":
        from ._compat import SglangOmniCompatibilityError, check

        try:
            names = check()
        except SglangOmniCompatibilityError as exc:
            print(f"not compatible: {exc}", file=sys.stderr)
            return 1
        print(f"sglang-omni {names.version}: every name the adapter relies on is there")
        return 0
    path = Path(args.site) / PTH_NAME
    if args.cmd == "install-pth":
        path.write_text(PTH_LINE)
        print(f"wrote {path}; set OMNIWIRE_SGLANG_OMNI=1 in the stages' environment")
    else:
        path.unlink(missing_ok=True)
        print(f"removed {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
