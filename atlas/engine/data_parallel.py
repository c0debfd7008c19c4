"""Data parallelism (`atlas serve --data-parallel-size N`, vLLM's `-dp N`): N engine processes, each a whole copy
of the model on GPUs of its own (with its --tensor-parallel-size x --pipeline-parallel-size ranks inside), and in
each front end one client that sends every request to one of them.

- Devices: replica r takes the r-th run of tp x pp GPUs among those visible (CUDA_VISIBLE_DEVICES, or all), set as
  its CUDA_VISIBLE_DEVICES before it touches CUDA, so each replica sees "its" GPUs as 0.. and its worker ranks
  inherit them. On the CPU every replica runs on the CPU.
- Routing: a user request (all of its prompts: they share pages and a fair share of slots) goes to one replica,
  the one with the fewest of this front end's requests in flight; among equally loaded ones, the one its first
  tokens hash to, so that requests with the same prefix meet that prefix's cached pages where loads are equal.
  Each replica schedules, caches and preempts on its own, as vLLM's replicas do.
- Everything else goes to every replica (LoRA adapters are loaded into each, health is all of them) or to the
  first (the Responses API's stored conversations, so that every front end finds them), and /metrics is the
  replicas' figures under one family each, told apart by an `engine` label (vLLM's name for it).
- A replica that dies ends the server, as the one engine's death does without -dp (the launcher exits with
  status 1 so that a supervisor restarts it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from atlas.errors import ConfigError
from atlas.sampling_params import SamplingParams

# First tokens a routing tie is broken by (a few pages: a shared system prompt, a conversation's first turn).
ROUTING_PREFIX_TOKENS = 256
# User requests whose replica is remembered for their later prompts (a multi-prompt request sends them together).
_GROUPS_KEPT = 4096


def replica_gpus(replica: int, replicas: int, per_replica: int, visible: Sequence[str]) -> list[str]:
    """The GPUs (as CUDA_VISIBLE_DEVICES entries) of `replica` among `visible`; a ConfigError when too few."""
    need = replicas * per_replica
    if len(visible) < need:
        raise ConfigError(f"--data-parallel-size {replicas} x {per_replica} GPU(s) per replica (--tensor-parallel-size "
                          f"x --pipeline-parallel-size) need {need} GPUs; {len(visible)} are visible "
                          "(CUDA_VISIBLE_DEVICES)")
    return list(visible[replica * per_replica:(replica + 1) * per_replica])


def visible_gpus() -> list[str]:
    """This process's GPUs as CUDA_VISIBLE_DEVICES entries, without initializing CUDA (torch counts them through
    NVML before CUDA starts, and does not cache the count then)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def place_replica(config, replica: int, replicas: int) -> None:
    """In replica `replica`'s engine process, before CUDA starts: its GPUs as this process's only ones."""
    from atlas.runtime.parallel_groups import device_type

    if replicas == 1 or device_type(config) != "cuda":
        return
    per_replica = config.tensor_parallel_size * config.pipeline_parallel_size
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(replica_gpus(replica, replicas, per_replica, visible_gpus()))


def check_data_parallel(config, replicas: int) -> None:
    """What -dp N can run with, checked before any replica starts."""
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise ConfigError(f"--data-parallel-size must be a positive integer, got {replicas!r}")
    if replicas == 1:
        return
    if config.nnodes > 1:
        raise ConfigError("--data-parallel-size with --nnodes > 1 is not implemented: replicas run on one node "
                          "(run one server per node behind a load balancer)")
    if config.enable_expert_parallel:
        raise ConfigError("--data-parallel-size with --enable-expert-parallel (experts spread over the replicas' "
                          "GPUs, vLLM's wide expert parallelism) is not implemented: each replica holds every "
                          "expert; leave one of the flags out")
    if config.master_port is not None:
        raise ConfigError("--data-parallel-size with --master-port: each replica's ranks meet on a free port of "
                          "their own; leave --master-port out")
    from atlas.runtime.parallel_groups import device_type

    if device_type(config) == "cuda":
        replica_gpus(replicas - 1, replicas, config.tensor_parallel_size * config.pipeline_parallel_size,
                     visible_gpus())


def metric_labels(model_name: str, replica: int | None) -> dict[str, str]:
    """The labels of every metric an engine exports: its model, and with -dp its replica (`engine`, as vLLM)."""
    return {"model_name": model_name} if replica is None else {"model_name": model_name, "engine": str(replica)}


def merge_metrics(texts: Sequence[bytes]) -> bytes:
    """The replicas' Prometheus exposition texts as one: each metric family once (the first text's HELP and TYPE
    lines), with the samples of every replica (told apart by their `engine` label) in replica order."""
    families: OrderedDict[bytes, list[bytes]] = OrderedDict()
    for text in texts:
        lines: list[bytes] | None = None
        new = False  # (whether this text brought the family: only then are its HELP and TYPE lines kept)
        for line in text.splitlines():
            if line.startswith((b"# HELP ", b"# TYPE ")):
                name = line.split(b" ", 3)[2]
                if lines is None or families.get(name) is not lines:
                    new = name not in families
                    lines = families.setdefault(name, [])
                if new:
                    lines.append(line)
            elif line and lines is not None:
                lines.append(line)
    return b"".join(line + b"\n" for lines in families.values() for line in lines)


class DataParallelClient:
    """A front end's handle on N engine processes (each an EngineClient), offering what the HTTP app uses of one."""

    def __init__(self, clients: Sequence[Any]):
        if not clients:
            raise ValueError("no replicas")
        self.clients = list(clients)
        first = self.clients[0].info
        # (what the app sizes itself by: the replicas' sequence slots together)
        self.info = dataclasses.replace(first, max_num_seqs=sum(c.info.max_num_seqs for c in self.clients))
        self.dead_listeners: list[Callable[[], None]] = []
        self._groups: OrderedDict[str, Any] = OrderedDict()  # user request -> its replica's client
        for client in self.clients:
            client.dead_listeners.append(self._on_dead)

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        for client in self.clients:
            client.start()

    def shutdown(self, timeout: float = 0.0) -> None:
        for client in self.clients:
            client.shutdown(timeout)

    @property
    def healthy(self) -> bool:
        return all(c.healthy for c in self.clients)

    @property
    def dead_reason(self) -> str | None:
        return next((c.dead_reason for c in self.clients if c.dead_reason is not None), None)

    def _on_dead(self) -> None:
        for listener in self.dead_listeners:
            listener()

    @property
    def max_waiting(self) -> int:
        """Requests that may wait for a slot beyond the running ones, over every replica (the front end's admission
        check); each replica's engine is given its share (0: no bound)."""
        return sum(c.max_waiting for c in self.clients)

    @max_waiting.setter
    def max_waiting(self, value: int) -> None:
        share = -(-value // len(self.clients))
        for client in self.clients:
            client.max_waiting = share

    # ------------------------------------------------------------------ requests
    def pick(self, prompt_ids: Sequence[int], group: str | None = None) -> Any:
        """The replica a request goes to (module docstring: routing)."""
        if group is not None and group in self._groups:
            return self._groups[group]
        least = min(c.num_streams for c in self.clients)
        candidates = [c for c in self.clients if c.num_streams == least]
        client = candidates[0]
        if len(candidates) > 1:
            head = ",".join(map(str, prompt_ids[:ROUTING_PREFIX_TOKENS])).encode()
            client = candidates[int.from_bytes(hashlib.blake2b(head, digest_size=4).digest(), "big") % len(candidates)]
        if group is not None:
            self._groups[group] = client
            if len(self._groups) > _GROUPS_KEPT:
                self._groups.popitem(last=False)
        return client

    async def add_request(self, prompt: Any, params: SamplingParams, request_id: str | None = None,
                          arrival_time: float | None = None, group: str | None = None, lora: str | None = None):
        ids = prompt.get("prompt_token_ids", ()) if isinstance(prompt, dict) else prompt
        client = self.pick(ids if isinstance(ids, (list, tuple)) else (), group)
        return await client.add_request(prompt, params, request_id, arrival_time, group=group, lora=lora)

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str | None = None,
                       arrival_time: float | None = None):
        stream = await self.add_request(prompt, params, request_id, arrival_time)
        async with stream:
            async for out in stream:
                yield out

    def abort(self, request_id: str) -> None:
        for client in self.clients:
            if client.has_request(request_id):
                client.abort(request_id)

    def cut(self, error: BaseException) -> int:
        return sum(client.cut(error) for client in self.clients)

    @property
    def num_streams(self) -> int:
        return sum(c.num_streams for c in self.clients)

    # ------------------------------------------------------------------ questions
    async def compile_constraint(self, spec: Any) -> None:
        # (each replica compiles what it is sent, from its own cache; this checks that the constraint compiles in
        # time, on the replica the next request is likeliest to go to)
        await self.pick(()).compile_constraint(spec)

    def enable_metrics(self, model_name: str) -> None:
        """(Each engine process keeps its metrics, labelled with its replica.)"""

    async def lora_call(self, method: str, *args: Any) -> Any:
        """Adapters are loaded into (and unloaded from) every replica; the first one's answer. A load that one
        replica refuses is taken back from those that took it, so that the replicas serve the same adapters."""
        results = []
        for client in self.clients:
            try:
                results.append(await client.lora_call(method, *args))
            except Exception:
                if method == "load_lora_adapter":
                    for loaded in self.clients[:len(results)]:
                        await loaded.lora_call("unload_lora_adapter", args[0])
                raise
        return results[0]

    async def render_metrics(self) -> bytes:
        return merge_metrics([await client.render_metrics() for client in self.clients])

    async def store_response(self, response_id: str, messages: list) -> None:
        await self.clients[0].store_response(response_id, messages)

    async def load_response(self, response_id: str) -> list | None:
        return await self.clients[0].load_response(response_id)
