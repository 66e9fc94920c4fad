"""The one place that assembles services from settings: what `astraflow` and `python -m workers.*` run.

Each `build_*` takes the run's settings and constructs one service from only what it uses: its own
sections and the few resolved run facts it needs, gathered by the matching `*_setup` (no service sees the
root `Settings`). The process around it (signals, the consumer name it holds, the bus it closes) is
`launch.services`.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astraflow.config import Settings
from astraflow.dataflow.service import Dataflow, DataflowSetup
from astraflow.errors import ConfigError
from astraflow.metrics_server import serve_stream_metrics
from astraflow.policies import PolicySettings
from astraflow.streams import Bus
from astraflow.workflows import sandbox
from astraflow.workflows.api import runs_tools

if TYPE_CHECKING:
    from astraflow.raas.worker import RaasSetup, RaasWorker
    from astraflow.trainer.service import TrainerService, TrainerSetup
    from astraflow.weights.settings import WeightsSettings


def dataflow_setup(settings: Settings) -> DataflowSetup:
    """What a dataflow replica gets of `settings`."""
    return DataflowSetup(
        dataflow=settings.dataflow,
        models=tuple(settings.run.models),
        trained=tuple(settings.trained),
        seed=settings.run.seed,
        sync=settings.trainer.mode == "sync",
        named_code=settings.named_code,
        eval=settings.eval,
        model_paths={m: settings.policy(m).engine.model for m in settings.run.models},
    )


def build_dataflow(settings: Settings, bus: Bus, name: str) -> Dataflow:
    """A dataflow replica named `name` (its consumer name) for the run's trained policies, serving its
    Prometheus series when `dataflow.metrics_port` is set."""
    dataflow = Dataflow(dataflow_setup(settings), bus, name)
    d = settings.dataflow
    endpoint = (d.metrics_host, d.metrics_port, "dataflow.metrics_port")
    metrics = serve_stream_metrics(settings.run.name, name, "dataflow", settings.run.models, endpoint)
    dataflow.collector.observe = metrics.observe
    return dataflow


def trainer_setup(settings: Settings, model: str) -> TrainerSetup:
    """What the trainer of policy `model` gets of `settings`: that policy's effective trainer settings
    (`Settings.policy`), the weights section (with the address its server advertises), the run's name
    and directory."""
    from astraflow.trainer.service import TrainerSetup

    trainer = settings.policy(model).trainer
    weights = served_weights(settings)
    e = settings.eval
    return TrainerSetup(trainer, weights, settings.run.name, settings.run.path, e.every, e.every_s)


def build_trainer(settings: Settings, bus: Bus, model: str) -> TrainerService:
    """The trainer of policy `model`, from that policy's effective trainer settings (`Settings.policy`)."""
    from astraflow.trainer.service import TrainerService

    service = TrainerService(trainer_setup(settings, model), bus, model)
    if service.rank == 0:  # under torchrun, the rank that writes the metrics serves them
        t = service.trainer
        own = "metrics_port" in settings.run.models[model].trainer  # the policy's, or the shared section's
        setting = f"run.models.{model}.trainer.metrics_port" if own else "trainer.metrics_port"
        endpoint = (t.metrics_host, t.metrics_port, setting)
        metrics = serve_stream_metrics(settings.run.name, f"trainer-{model}", "trainer", [model], endpoint)
        service.observe = metrics.observe
    return service


def raas_setup(settings: Settings) -> RaasSetup:
    """What a RaaS worker gets of `settings`: the raas section and every policy's effective settings."""
    from astraflow.raas.worker import RaasSetup

    return RaasSetup(
        raas=settings.raas,
        policies={m: settings.policy(m) for m in settings.run.models},
        trained=frozenset(settings.trained),
        sync=settings.trainer.mode == "sync",
        named_code=settings.named_code,
    )


def served_weights(settings: Settings) -> WeightsSettings:
    """The weights section of a process that serves weights on this host, with the address it listens
    on filled in (`weights.address`): loopback for a local run, else one that reaches where Redis is."""
    from astraflow.weights import address

    contact = address.redis_contact(settings.redis.url, settings.redis.sentinels)
    return address.resolved(settings.weights, contact)


def model_dir(policy: PolicySettings) -> Path | None:
    """The engine's model directory (its config files go with every pulled version), if it has one."""
    return Path(policy.engine.model) if policy.engine.model else None


def load_tokenizers(policies: list[PolicySettings]) -> dict[str, Any]:
    """Each policy's tokenizer (`engine.tokenizer`, else the model directory); an `openai` endpoint
    names no directory, so it needs `engine.tokenizer`."""
    from transformers import AutoTokenizer

    from astraflow.engines import resolve_type

    tokenizers = {}
    for p in policies:
        source = p.engine.tokenizer or (p.engine.model if resolve_type(p.engine) != "openai" else None)
        if source is None:
            raise ConfigError(
                f"run.models.{p.name}.engine.tokenizer: the openai engine of policy {p.name!r} needs the "
                "directory of its model's tokenizer (workflows send it token ids)"
            )
        tokenizers[p.name] = AutoTokenizer.from_pretrained(source)
    return tokenizers


@contextlib.asynccontextmanager
async def build_raas(settings: Settings, bus: Bus, wid: str) -> AsyncIterator[RaasWorker]:
    """A RaaS worker named `wid` with one started engine per policy (each from that policy's engine
    settings) and a weight receiver per trained policy; engines, receivers and the weight server are
    closed on exit."""
    from astraflow.engines import make_engine
    from astraflow.raas.worker import RaasWorker
    from astraflow.weights.files import buffer_root
    from astraflow.weights.published import run_secret
    from astraflow.weights.receiver import WeightReceiver
    from astraflow.weights.server import WeightServer

    tools = runs_tools(settings.dataflow.feeder.workflow, settings.raas.workflow_options)
    await asyncio.to_thread(sandbox.require, settings.raas.sandbox, tools)  # before anything slow starts
    log_dir = settings.run.path / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    policies = [settings.policy(m) for m in settings.run.models]
    engines = {}
    for i, p in enumerate(policies):
        shared = settings.engine.port
        port = p.engine.port + i if shared and p.engine.port == shared else p.engine.port  # one per model
        engines[p.name] = make_engine(
            p.engine.model_copy(update={"port": port}), log_dir / f"{wid}-{p.name}.log"
        )
    # In a thread: importing transformers holds the loop for seconds, longer than the consumer name's
    # lease, which the loop renews (a lapsed name leaves the first heartbeat unwritten).
    tokenizers = await asyncio.to_thread(load_tokenizers, policies)
    w = served_weights(settings)
    secret = await run_secret(bus, w)
    server = WeightServer.from_settings(secret, w)
    root = buffer_root(w, settings.run.name, wid)
    receivers = {  # a policy not trained never gets new weights
        p.name: WeightReceiver(bus, w, p.name, root, secret, server, settings.raas.region, model_dir(p))
        for p in policies
        if p.train
    }
    try:
        for engine in engines.values():
            await engine.start()
        yield RaasWorker(raas_setup(settings), bus, engines, wid, tokenizers, receivers)
    finally:
        for engine in engines.values():
            await engine.close()
        for receiver in receivers.values():
            receiver.close()
        server.close()
        shutil.rmtree(root, ignore_errors=True)
