"""The `astraflow` command: its parser, and the handlers that start a run or one worker. The operator
commands live in `astraflow.ops`; every handler is named here as `module:function` and imported when its
command runs, so `astraflow --help` is instant."""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
import traceback
from collections.abc import Callable

DEFAULT_RECIPE = "addition-tiny"


def main(argv: list[str] | None = None) -> int:
    from astraflow import logs

    logs.configure()  # JSON off a terminal from the first event on (a worker sets its level later)
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "recipe_flag", None):  # deprecated spelling
        if args.recipe is not None:
            parser.error(f"the recipe twice: {args.recipe} and --recipe {args.recipe_flag}")
        print(
            "astraflow: warning: --recipe is deprecated: name the recipe first (COMMAND RECIPE)",
            file=sys.stderr,
        )
        args.recipe = args.recipe_flag
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    try:
        return handler(args.handler)(args) or 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # the command's boundary: one line, the fix when there is one
        if getattr(args, "debug", False):
            traceback.print_exception(e)
        print(f"astraflow: {one_line(e)}", file=sys.stderr)
        return 1


def handler(ref: str):
    """The function `module:function` names (imported now: a command's imports wait for its use)."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def one_line(e: BaseException) -> str:
    """What failed, in a line, and how to fix it when that is known (every error raised on purpose says
    so itself); anything else by its type and message."""
    from redis import exceptions as redis

    from astraflow.errors import AstraflowError, BusConnectionError

    if isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:  # a task group's one failure
        return one_line(e.exceptions[0])
    if isinstance(e, redis.AuthenticationError | redis.AuthorizationError):
        where = "the --redis-file URL, redis.password or redis.password_file"
        return f"Redis refused the credentials: {e} (check the password: {where})"
    if isinstance(e, redis.NoPermissionError):
        return f"Redis refused a command to this user: {e} (its ACL lacks it: see `astraflow redis acl`)"
    if isinstance(e, redis.ConnectionError | redis.TimeoutError | BusConnectionError):
        what = str(e) if isinstance(e, BusConnectionError) else f"Redis unreachable: {e}"
        return f"{what} (is it running? check --redis, --redis-file or redis.url)"
    if isinstance(e, AstraflowError):
        return str(e)
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.filename}: {e.strerror}"
    return f"{type(e).__name__}: {e} (--debug shows the traceback)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="astraflow", description="RL of LLMs as a dataflow on Redis Streams.")
    p.add_argument("--version", action="version", version=f"astraflow {_version()}")
    sub = p.add_subparsers(metavar="COMMAND")
    command = functools.partial(_command, sub)
    _run_commands(command)
    _worker_commands(command)
    _admin_commands(command)
    _data_commands(command)
    _model_commands(sub)
    return p


Command = Callable[..., argparse.ArgumentParser]
"""`_command` bound to the parser's subcommands: (name, handler, help, recipe=True) -> its parser."""


def _command(
    sub: argparse._SubParsersAction, name: str, ref: str, help: str, recipe: bool = True
) -> argparse.ArgumentParser:
    """Add the command `name`, run by the handler `ref` (`module:function`), with the options every
    command takes (and its recipe, with `recipe`)."""
    c = sub.add_parser(name, help=help, description=help)
    if recipe:
        c.add_argument("recipe", nargs="?", help="recipe YAML, or a shipped recipe's name (addition-tiny)")
        # the first positional in every command; `--recipe` as it was in `trace` and `workflow`
        c.add_argument("--recipe", dest="recipe_flag", help=argparse.SUPPRESS)
    c.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a setting (repeatable)",
    )
    c.add_argument("--run", help="run name (run.name)")
    c.add_argument("--redis", help="redis://host:port/db of a shared Redis (default: the embedded one)")
    c.add_argument("--redis-file", metavar="PATH", help="read the --redis URL from PATH")
    c.add_argument("--debug", action="store_true", help="show the traceback of an error")
    c.set_defaults(handler=ref)
    return c


def _run_commands(command: Command) -> None:
    """A run on this machine and what watches or records it."""
    run = command(
        "run",
        "astraflow.ops.start:cmd_run",
        f"run a recipe end to end on one machine (default {DEFAULT_RECIPE})",
    )
    run.set_defaults(default_recipe=DEFAULT_RECIPE)
    run.add_argument("--keep-redis", action="store_true", help="leave the embedded Redis running afterwards")
    fresh = run.add_mutually_exclusive_group()
    fresh.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped run from its directory")
    fresh.add_argument("--overwrite", action="store_true", help="replace what run.dir holds (not a live run)")
    command(
        "top",
        "astraflow.ops.top:cmd_top",
        "live progress of a run (also one started elsewhere: --redis URL --run NAME)",
    )
    record = command(
        "record",
        "astraflow.ops.record:cmd_record",
        "write a run's metrics.jsonl, summary.json, reward.png (any run)",
    )
    record.add_argument("--dir", metavar="D", help="where to write them (default: run.dir)")
    record.add_argument("--once", action="store_true", help="record what the run holds now, then exit")
    command(
        "inspect",
        "astraflow.ops.inspect:cmd_inspect",
        "every stream: length, groups, consumers, pending, lag; dead letters",
    )
    command("config", "astraflow.ops.context:cmd_config", "print the effective settings (secrets masked)")
    redis = command(
        "redis",
        "astraflow.ops.admin:cmd_redis",
        "the embedded redis-server (start/stop/status); a run's ACL users",
        False,
    )
    redis.add_argument("action", choices=["start", "stop", "status", "acl"])
    redis.add_argument("--apply", action="store_true", help="acl: install the users on the configured Redis")
    redis.add_argument("--passwords", metavar="FILE", help="acl: role=password lines (made if missing)")
    redis.add_argument(
        "--raas-ids",
        metavar="ID,...",
        help="acl: one user per RaaS id (raas.id), each holding only its own name, instead of one shared",
    )


def _worker_commands(command: Command) -> None:
    """The processes of a distributed run, and their health checks."""
    raas = command(
        "raas", "astraflow.ops.start:cmd_raas", "run a RaaS worker: prompts in, rollout groups out"
    )
    trainer = command(
        "trainer",
        "astraflow.ops.start:cmd_trainer",
        "run the trainer of one policy: batches in, versions out",
    )
    trainer.add_argument("--model", help="the policy to train (default: the run's first trained policy)")
    dataflow = command(
        "dataflow", "astraflow.ops.start:cmd_dataflow", "run a dataflow replica: feeder, collector, batches"
    )
    for server in (raas, trainer):  # they serve weights
        server.add_argument(
            "--advertise", metavar="ADDR", help="HOST[:PORT] others pull weights from (weights.advertise)"
        )
    for worker in (raas, trainer, dataflow):  # joining a running run needs no flag
        worker.add_argument("--resume", action="store_true", help="continue a stopped run, or adopt keys")
    health = command(
        "health",
        "astraflow.ops.health:cmd_health",
        "exit 0 if this host's worker of a role is ready (or alive)",
    )
    health.add_argument("--role", required=True, choices=["raas", "dataflow", "trainer"])
    health.add_argument("--name", help="the worker's consumer name (default: its id, else this host's)")
    health.add_argument("--model", help="trainer: the policy it trains (default: the first trained)")
    health.add_argument("--live", action="store_true", help="liveness: judge only the worker's own signal")
    health.add_argument("--max-idle-s", type=float, help="bound on the consumer's idle s (default: by role)")


def _admin_commands(command: Command) -> None:
    """Commands on a run's Redis state: clear, audit, scale, push."""
    clear = command(
        "clear", "astraflow.ops.admin:cmd_clear", "delete every Redis key of a run (--run NAME)", recipe=False
    )
    clear.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    clear.add_argument(
        "--unknown-groups", action="store_true", help="only remove consumer groups that are not the run's"
    )
    ledger = command(
        "ledger",
        "astraflow.ops.audit:cmd_ledger",
        "print the run's ledger and check it balances (exit 1 if not)",
    )
    ledger.add_argument("--json", action="store_true", help="machine-readable output")
    scale = command(
        "scale",
        "astraflow.ops.scale:cmd_scale",
        "how many RaaS workers the run needs, and why (--serve: for KEDA)",
    )
    scale.add_argument("--headroom", type=float, default=1.2, help="margin over the demand (default 1.2)")
    scale.add_argument("--window", type=int, default=20, help="recent trainer steps measured (default 20)")
    scale.add_argument("--serve", type=int, metavar="PORT", help="serve Prometheus gauges on PORT, refreshed")
    scale.add_argument("--bind", default="0.0.0.0", help="--serve: address to listen on (default all)")
    scale.add_argument("--interval", type=float, default=5.0, help="--serve: seconds between refreshes")
    push = command(
        "workflow", "astraflow.ops.admin:cmd_workflow", "push a workflow class to a running run's RaaS"
    )
    push.add_argument("action", choices=["push"])
    push.add_argument("ref", metavar="module:Class", help="the RolloutWorkflow subclass to push")
    push.add_argument("--name", help="the name prompt groups use (default: module:Class)")
    trace = command("trace", "astraflow.ops.audit:cmd_trace", "show the path of one prompt group")
    trace.add_argument("uid", help="the prompt group's uid (e.g. e0r123)")


def _data_commands(command: Command) -> None:
    """Reading a run's entries and metrics out, and its checkpoints."""
    peek = command(
        "peek",
        "astraflow.ops.peek:cmd_peek",
        "decode a run's stream entries (or a hash) to JSON",
        recipe=False,
    )
    peek.add_argument(
        "stream", metavar="STREAM", help="prompts, rollouts, batches:<model>, dead, raas:<id>, ..."
    )
    peek.add_argument("--count", type=int, default=1, help="the newest N entries (default 1)")
    peek.add_argument("--id", help="the entry with this id")
    peek.add_argument(
        "--max-bytes", type=int, help="decode no entry larger than this many bytes (default 16 MiB)"
    )
    peek.add_argument("--recipe", help="recipe YAML or a shipped recipe's name (for the run's settings)")
    track = command(
        "track",
        "astraflow.ops.track:cmd_track",
        "feed the run's metrics to TensorBoard/W&B/MLflow (tracking.sinks)",
    )
    track.add_argument("--once", action="store_true", help="log what the stream holds now, then exit")
    export = command(
        "export",
        "astraflow.ops.models:cmd_export",
        "a checkpoint as a Hugging Face directory (transformers, vLLM)",
    )
    export.add_argument("out", metavar="OUT", help="the directory to write (new or empty)")
    export.add_argument("--version", type=int, help="the checkpoint's version (default: the newest)")
    export.add_argument("--model", help="the policy (default: the run's first trained policy)")
    export.add_argument("--checkpoint", metavar="DIR", help="a checkpoint directory (v00000012) instead")
    export.add_argument(
        "--model-dir", metavar="DIR", help="config and tokenizer (default: the policy's model)"
    )
    export.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights' dtype")
    export.add_argument(
        "--merge", action="store_true", help="LoRA: the adapter merged into its base (default: the adapter)"
    )


def _model_commands(sub: argparse._SubParsersAction) -> None:
    """`astraflow model ...`: building models (no recipe, no Redis)."""
    model = sub.add_parser("model", help="build models", description="build models")
    model_sub = model.add_subparsers(metavar="KIND", required=True)
    tiny = model_sub.add_parser("tiny", help="a tiny Qwen2 model and BPE tokenizer, built locally")
    tiny.add_argument("out_dir")
    tiny.add_argument("--warm-start", metavar="TASK", help="add supervised steps on a built-in task")
    tiny.add_argument("--steps", type=int, default=300, help="warm-start steps (default 300)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--debug", action="store_true", help="show the traceback of an error")
    tiny.set_defaults(handler="astraflow.ops.models:cmd_model_tiny")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("astraflow")
    except PackageNotFoundError:  # a source checkout on PYTHONPATH
        from astraflow import __version__

        return __version__


if __name__ == "__main__":
    sys.exit(main())
