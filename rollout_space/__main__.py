"""``python -m rollout_space --model MODEL --store STORE --port PORT [--token T] [vLLM options]``

Every ``vllm serve`` engine option is accepted (``--enforce-eager``, ``--max-model-len``,
``--tensor-parallel-size``, ...). The bearer token for ``/update``, ``/pause``, ``/resume`` and
``/weights/digest?fresh=true`` comes from ``--token`` or ``DELTASYNC_TOKEN``. Bound to anything but a
loopback address (the default ``--host`` is every interface) the server refuses to start without
one, unless ``--insecure-no-token`` is given; the refusal comes before vLLM loads anything.
"""

from __future__ import annotations

import logging
import os
import sys

from shared.access import open_without_token
from shared.spaces import Deployment

DEFAULT_MAX_BODY_BYTES = 16 << 20


def default_store() -> str:
    if store := os.environ.get("DELTASYNC_STORE"):
        return store
    home = Deployment.of_space(os.environ.get("SPACE_ID"))  # a duplicated Space finds its bucket
    return home.store if home else "./bucket"


def parse_args(argv: list[str] | None = None):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="python -m rollout_space", description=__doc__))
    g = parser.add_argument_group("DeltaSync")
    g.add_argument("--store", default=default_store(),
                   help="version chain: a folder, hf://buckets/ns/name/prefix or s3://bucket/prefix (env "
                        "DELTASYNC_STORE; inside a Space hf://buckets/<namespace>/deltasync/run1, else ./bucket)")
    g.add_argument("--token", default=os.environ.get("DELTASYNC_TOKEN"),
                   help="bearer token for /update, /pause, /resume and /weights/digest?fresh=true (env "
                        "DELTASYNC_TOKEN, which keeps it out of the process list); required on a "
                        "non-loopback --host")
    g.add_argument("--insecure-no-token", action="store_true",
                   help="serve on a non-loopback address without a token: anyone who can reach the port "
                        "may then update, pause and resume this replica")
    g.add_argument("--max-body-bytes", type=int,
                   default=int(os.environ.get("DELTASYNC_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES)),
                   help="largest HTTP request body; larger ones get 413 (env DELTASYNC_MAX_BODY_BYTES, "
                        "default 16 MiB)")
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
    if args.max_body_bytes < 1:
        parser.error("--max-body-bytes must be at least 1")
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
    if open_without_token(args.host, args.token, args.insecure_no_token):
        print(f"python -m rollout_space: refusing to serve on {args.host or '0.0.0.0'} without an update "
              "token (anyone could update, pause or resume this replica); set --token or DELTASYNC_TOKEN, "
              "or pass --insecure-no-token", file=sys.stderr)
        sys.exit(2)
    from .server import create_app

    app = create_app(args)
    uvicorn.run(app, host=args.host or "0.0.0.0", port=args.port, log_level="info",
                timeout_keep_alive=30)


if __name__ == "__main__":
    main(sys.argv[1:])
