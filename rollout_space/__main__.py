"""A vLLM replica that follows a DeltaSync version chain: it serves the OpenAI API of `vllm serve`
and applies each new version's exact bf16 delta to its live weights in place.

The bearer token for /update, /pause, /resume and /weights/digest?fresh=true comes from --token or
DELTASYNC_TOKEN. Bound to anything but a loopback address (the default --host is every interface)
the server refuses to start without one, unless --insecure-no-token is given; the refusal comes
before vLLM loads anything.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from shared.access import open_without_token
from shared.spaces import space_setting

DEFAULT_MAX_BODY_BYTES = 16 << 20
USAGE = ("python -m rollout_space --model MODEL --store STORE [--host HOST] [--port PORT] [--token TOKEN]\n"
         "                             [DeltaSync options] [any `vllm serve` option]")
ENGINE_HELP = """vLLM options:
  Every `vllm serve` option is accepted (--enforce-eager, --max-model-len,
  --tensor-parallel-size, --api-key, ...). --help=all lists all of them,
  --help=GROUP one group (ModelConfig, CacheConfig, ParallelConfig, Frontend,
  ...), --help=WORD the options whose name contains WORD.
"""
_SERVER_FLAGS = ("--model", "--host", "--port", "--api-key")


def _parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser, SortedHelpFormatter

    class Formatter(SortedHelpFormatter):
        def _get_help_string(self, action):  # ours state their defaults (never the token's value)
            return action.help if getattr(action, "deltasync", False) else super()._get_help_string(action)

    class Parser(FlexibleArgumentParser):
        """``--help`` shows our options and the few server ones first; ``--help=all`` or
        ``--help=GROUP`` shows vLLM's own, as ``vllm serve`` does."""

        def format_help(self):
            if self._search_keyword is not None:
                return super().format_help()
            f = self._get_formatter()
            f.add_usage(self.usage, [], [])
            f.add_text(self.description)
            ours = next(g for g in self._action_groups if g.title == "DeltaSync")
            f.start_section("DeltaSync options")
            argparse.HelpFormatter.add_arguments(f, ours._group_actions)  # in their order, not sorted
            f.end_section()
            f.start_section("server options (vLLM's)")
            f.add_arguments([a for a in self._actions if set(a.option_strings) & set(_SERVER_FLAGS)])
            f.end_section()
            return f.format_help() + "\n" + ENGINE_HELP

    return make_arg_parser(Parser(prog="python -m rollout_space", usage=USAGE, description=__doc__,
                                  formatter_class=Formatter))


def parse_args(argv: list[str] | None = None):
    parser = _parser()
    g = parser.add_argument_group("DeltaSync")
    store = space_setting("rollout", "DELTASYNC_STORE")
    options = [
        (("--store",), dict(default=store, help=(
            "version chain to follow: a folder, hf://buckets/NAMESPACE/NAME[/PREFIX] (token: HF_TOKEN) or "
            "s3://BUCKET[/PREFIX] (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY). Required; default: env "
            "DELTASYNC_STORE, or inside a Space hf://buckets/<namespace>/deltasync/run1 derived from "
            f"SPACE_ID ({'here: ' + store if store else 'neither is set here'})"))),
        (("--token",), dict(default=os.environ.get("DELTASYNC_TOKEN"), help=(
            "bearer token for /update, /pause, /resume and /weights/digest?fresh=true; required on a "
            "non-loopback --host (default: env DELTASYNC_TOKEN, which keeps it out of the process list; "
            f"{'set' if os.environ.get('DELTASYNC_TOKEN') else 'unset'} here)"))),
        (("--insecure-no-token",), dict(action="store_true", help=(
            "serve on a non-loopback address without a token: anyone who can reach the port may then "
            "update, pause and resume this replica (default: off)"))),
        (("--max-body-bytes",), dict(type=int, default=int(os.environ.get("DELTASYNC_MAX_BODY_BYTES",
                                                                          DEFAULT_MAX_BODY_BYTES)),
                                     help="largest HTTP request body; larger ones get 413 (default: %(default)s; "
                                          "env DELTASYNC_MAX_BODY_BYTES, else 16 MiB)")),
        (("--map-cache",), dict(default=os.environ.get("DELTASYNC_MAP_CACHE"), help=(
            "folder for cached checkpoint->engine maps (default: env DELTASYNC_MAP_CACHE, else "
            "~/.cache/deltasync/maps)"))),
        (("--work-dir",), dict(default=None, help="folder for downloaded objects (default: a new temporary "
                                                  "folder)")),
        (("--poll-s",), dict(type=float, default=10.0, help=(
            "check the store's latest version this often, in seconds, in case a notification is lost; "
            "0: only on POST /update (default: %(default)s)"))),
        (("--no-predict",), dict(dest="predict", action="store_false", help=(
            "skip predicting each touched tensor's fingerprint before the write; the read-back audit after "
            "it still runs (default: predict)"))),
        (("--audit-every",), dict(type=int, default=int(os.environ.get("DELTASYNC_AUDIT_EVERY", 8)), metavar="K",
                                  help=("after each delta, re-read the whole fingerprints of 1/K of the tensors, "
                                        "so every tensor is re-verified every K versions; 1: all, every version "
                                        "(default: %(default)s; env DELTASYNC_AUDIT_EVERY)"))),
        (("--write-probe",), dict(choices=("start", "dense", "off"), default="start", help=(
            "check that writes into the engine's parameters reach its output (the read-back audit cannot "
            "see a backend computing from a copy): perturb each parameter, a fixed prompt's logprobs must "
            "move, restore it, they must come back bit for bit; on failure the replica refuses generation "
            "and updates (503). start: at start-up, before serving; dense: also after every dense load "
            "while serving (generation held meanwhile); off: only on POST /probe (default: %(default)s)"))),
        (("--write-probe-params",), dict(type=int, default=0, metavar="K", help=(
            "check K parameters drawn at random per probe instead of all (one forward each; 0: all; "
            "default: %(default)s)"))),
    ]
    for flags, kwargs in options:
        g.add_argument(*flags, **kwargs).deltasync = True
    for action in parser._actions:  # vLLM's --host default (None) means every interface, here too
        if "--host" in action.option_strings:
            action.help, action.deltasync = ("address to listen on (default: every interface, 0.0.0.0; "
                                             "anything but loopback needs --token)"), True
    args = parser.parse_args(argv)
    if not args.store:
        parser.error("--store is required (or set DELTASYNC_STORE): a folder, "
                     "hf://buckets/NAMESPACE/NAME[/PREFIX] or s3://BUCKET[/PREFIX]")
    if args.audit_every < 1:
        parser.error("--audit-every must be 1 or more")
    if args.write_probe_params < 0:
        parser.error("--write-probe-params must be 0 (all) or more")
    if args.max_body_bytes < 1:
        parser.error("--max-body-bytes must be at least 1")
    if args.model_tag and not getattr(args, "model", None):
        args.model = args.model_tag
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and args.kv_cache_memory_bytes is None:
        # vLLM's default reserves 92% of the NUMA node for the KV cache; a Space shares the box.
        args.kv_cache_memory_bytes = int(os.environ.get("DELTASYNC_CPU_KV_BYTES", 1 << 30))
    if current_platform.is_cpu() and args.tensor_parallel_size == 1:
        # vLLM's CPU platform otherwise runs the single worker in a third process, spawned with a
        # fresh import of vLLM: on this 2-core machine start-up goes from ~76 s to ~40 s, and every
        # collective_rpc loses a hop. The worker then lives inside EngineCore, as on GPU at TP=1.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return args


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)  # before logging is set up: --help and usage errors stay plain
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if open_without_token(args.host, args.token, args.insecure_no_token):
        print(f"python -m rollout_space: refusing to serve on {args.host or '0.0.0.0'} without an update "
              "token (anyone could update, pause or resume this replica); set --token or DELTASYNC_TOKEN, "
              "or pass --insecure-no-token", file=sys.stderr)
        sys.exit(2)
    from .server import create_app

    config = uvicorn.Config(create_app(args), host=args.host or "0.0.0.0", port=args.port, log_level="info",
                            timeout_keep_alive=30)
    # Bound now, before vLLM starts: its engine picks free ports of its own while it loads (minutes
    # for a large model), and a port taken meanwhile would only be found once the model is loaded.
    sock = config.bind_socket()
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main(sys.argv[1:])
