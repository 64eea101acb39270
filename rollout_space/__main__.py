"""``python -m rollout_space --model MODEL --store STORE --port PORT [--token T] [vLLM options]``

Every ``vllm serve`` engine option is accepted (``--enforce-eager``, ``--max-model-len``,
``--tensor-parallel-size``, ...). The bearer token for ``/update``, ``/pause`` and ``/resume``
comes from ``--token`` or ``DELTASYNC_TOKEN``.
"""

from __future__ import annotations

import logging
import os
import sys


def parse_args(argv: list[str] | None = None):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="python -m rollout_space", description=__doc__))
    g = parser.add_argument_group("DeltaSync")
    g.add_argument("--store", default=os.environ.get("DELTASYNC_STORE", "./bucket"),
                   help="version chain: a folder, hf://buckets/ns/name/prefix or s3://bucket/prefix")
    g.add_argument("--token", default=os.environ.get("DELTASYNC_TOKEN"),
                   help="bearer token for /update, /pause, /resume (env DELTASYNC_TOKEN)")
    g.add_argument("--map-cache", default=os.environ.get("DELTASYNC_MAP_CACHE"),
                   help="folder for cached checkpoint->engine maps (default ~/.cache/deltasync/maps)")
    g.add_argument("--work-dir", default=None, help="folder for downloaded objects (default: a temp dir)")
    g.add_argument("--poll-s", type=float, default=10.0,
                   help="check the store's latest version this often, in case a notification is lost "
                        "(0: only on POST /update)")
    g.add_argument("--no-predict", dest="predict", action="store_false",
                   help="skip predicting each touched tensor's digest before the write (the read-back "
                        "audit after it still runs)")
    args = parser.parse_args(argv)
    if args.model_tag and not getattr(args, "model", None):
        args.model = args.model_tag
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and args.kv_cache_memory_bytes is None:
        # vLLM's default reserves 92% of the NUMA node for the KV cache; a Space shares the box.
        args.kv_cache_memory_bytes = int(os.environ.get("DELTASYNC_CPU_KV_BYTES", 1 << 30))
    return args


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    from .server import create_app

    app = create_app(args)
    uvicorn.run(app, host=args.host or "0.0.0.0", port=args.port, log_level="info",
                timeout_keep_alive=30)


if __name__ == "__main__":
    main(sys.argv[1:])
