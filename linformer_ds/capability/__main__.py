"""``python -m linformer_ds.capability {copy,probe} ...``: see docs/capability.md."""

import argparse

import torch

from linformer_ds.context_curve import ContextCurveError
from linformer_ds.log import LogLevelError, get_logger, info_to, setup_logging

from . import copy_distance, probe

logger = get_logger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m linformer_ds.capability",
        description="Can a model retrieve what it saw far away? copy: a passage of real rows "
        "repeated at a distance; probe: synthetic recall and copy, trained per attention kind.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    copy_distance.add_arguments(
        sub.add_parser("copy", help="copy at distance on real rows, for an export or checkpoint")
    )
    probe.add_arguments(
        sub.add_parser("probe", help="train small models of each kind on synthetic probes")
    )
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; 1 is fastest on a shared machine)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    module = copy_distance if args.command == "copy" else probe
    threads = torch.get_num_threads()
    try:
        setup_logging()
        if args.threads is not None:
            if args.threads < 1:
                raise probe.ProbeError(f"--threads {args.threads}: must be at least 1")
            torch.set_num_threads(args.threads)
        with info_to("stderr"):  # progress on stderr; stdout holds the result
            result = module.run(args, logger.info)
    except (ContextCurveError, probe.ProbeError, LogLevelError) as e:
        logger.error(f"capability {args.command}: error: {' '.join(str(e).split())}")
        return 2
    except (RuntimeError, ValueError) as e:  # the model refused an input (one line)
        logger.error(f"capability {args.command}: error: {' '.join(str(e).split())[:400]}")
        return 1
    finally:
        torch.set_num_threads(threads)  # (a caller's setting, as it was)
    module.report(result, args.out)
    return 0


if __name__ == "__main__":
    from linformer_ds import entry

    entry.run(main)
