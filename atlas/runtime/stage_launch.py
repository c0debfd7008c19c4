"""Pipeline parallelism, one stage's share of a step: its layers (replayed from a graph where one fits), from the
previous stage's [x | residual] on a later stage; what it sends on, and the first stage's logits, sampling and
read-back once the last stage has sent the rows that need logits back to it."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from atlas.layers.parallel import split_evenly
from atlas.runtime.batch import StepBatch, StepResult
from atlas.runtime.step_inputs import StepInputs
from atlas.runtime.step_output import NO_RESULT, PromptLogprobPlan, StepHandle

if TYPE_CHECKING:
    from atlas.config import ModelConfig
    from atlas.models.base import CausalLM
    from atlas.runtime.capture import HiddenCapture
    from atlas.runtime.graph_plan import GraphPlan
    from atlas.runtime.parallel import ParallelState
    from atlas.runtime.parallel_protocol import StepInfo
    from atlas.runtime.state_slots import StateSlots
    from atlas.runtime.step_inputs import InputPreparer
    from atlas.runtime.step_output import StepOutput
    from atlas.runtime.target_caches import TargetCaches


class StageLauncher:
    """Launches the steps of a runner that holds one pipeline stage's layers."""

    def __init__(self, model: CausalLM, model_config: ModelConfig, parallel: ParallelState | None,
                 device: torch.device, dtype: torch.dtype, caches: TargetCaches, graph_plan: GraphPlan,
                 states: StateSlots, output: StepOutput):
        """The runner's parts, shared: `caches` is filled in after this is made, `graph_plan` captures its
        graphs later. (Every runner has one; only one with pipeline stages (`parallel.pp > 1`) launches.)"""
        self.model, self.model_config, self.parallel = model, model_config, parallel
        self.device, self.dtype = device, dtype
        self.caches, self.graph_plan, self.states, self.output = caches, graph_plan, states, output

    @functools.cached_property
    def stage_captures(self) -> list[list[int]]:
        """For each pipeline stage, the capture layers among its layers, in capture_layers' order (read at
        the first step: the engine sets capture_layers before any)."""
        total, pp = self.model_config.num_hidden_layers, self.parallel.pp
        spans = [split_evenly(total, pp, j) for j in range(pp)]
        return [[i for i in self.caches.capture_layers if first <= i < first + count] for first, count in spans]

    def launch(self, batch: StepBatch, inputs: StepInputs, plan: PromptLogprobPlan, info: StepInfo,
               capture: HiddenCapture | None, preparer: InputPreparer) -> StepHandle:
        """Pipeline parallelism: this stage's layers. A later stage starts from the previous stage's
        [x | residual]; the last one sends the rows that need logits (all rows when prompt logprobs are
        wanted) back to the first stage, which makes the logits and samples when the step is finished.
        With a drafter that reads captured layers, stage s >= 1 appends its layers' residual streams (one
        [rows, hidden] slab a layer) to what it sends on, and the last stage sends all those slabs to the
        first, which puts them beside its own in capture_layers' order (graphed steps return them too).
        `capture` and `preparer`: the runner's, as ModelRunner.launch passes them to StepOutput.sample."""
        par = self.parallel
        rows_total, width = inputs.input_ids.shape[0], self.model_config.hidden_size
        per_stage = self.stage_captures
        stage = par.pp_rank
        carried = sum(len(c) for c in per_stage[1:stage])  # slabs the previous stage sends on
        stage_in = carried_slabs = None
        if not par.is_first_stage:
            stage_in = par.receive_previous((2 + carried, rows_total, width), self.dtype, self.device)
            stage_in, carried_slabs = stage_in[:2], stage_in[2:]
        graphs = self.graph_plan.step_graphs.get(inputs.meta.max_query_len)
        captured = None
        if graphs is not None and graphs.can_run(inputs.meta) and not inputs.meta.state_splits:
            if stage_in is not None:
                self.graph_plan.stage_in[:, :rows_total].copy_(stage_in)
            out, *rest = graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
            # Copies: the next replay rewrites the graph's outputs while this step's send may still read them,
            # and the first stage reads its captured rows only when the step finishes.
            out = out.clone() if par.is_last_stage else out.transpose(0, 1).contiguous()
            captured = rest[0].clone() if rest else None
        else:
            out, captured = self.model(inputs.input_ids, inputs.positions, self.caches.kv_caches, inputs.meta,
                                       self.caches.capture_layers, intermediate=stage_in)
        if batch.state_saves:  # (this stage's layers' states at the end of a prompt page: ModelRunner.launch)
            self.states.save(batch)
        slabs = None
        if not par.is_first_stage and (carried or per_stage[stage]):
            own = (captured.view(rows_total, len(per_stage[stage]), width).transpose(0, 1)
                   if per_stage[stage] else carried_slabs[:0])
            slabs = torch.cat([carried_slabs, own])
        all_rows = bool(plan.rows)
        if not par.is_last_stage:
            par.send_next(out if slabs is None else torch.cat([out, slabs]))
        else:
            if all_rows or inputs.num_sample_rows:
                par.send_to_first(out if all_rows else out[inputs.sample_rows])
            if slabs is not None:
                par.send_to_first(slabs.contiguous())
        if not par.is_first_stage:
            return StepHandle(lambda: NO_RESULT)
        later = [i for c in per_stage[1:] for i in c]  # the layers of the slabs the last stage sends back

        @torch.inference_mode()
        def finish() -> StepResult:
            if par.is_driver:
                par.announce_finish(info)
            n = rows_total if all_rows else inputs.num_sample_rows
            rows = par.receive_from_last((n, width), self.dtype, self.device) if n else None
            step_captured = captured
            if later:
                back = par.receive_from_last((len(later), rows_total, width), self.dtype, self.device)
                by_layer = dict(zip(later, back.unbind(0), strict=True))
                if captured is not None:
                    by_layer.update(zip(per_stage[0], captured.view(rows_total, -1, width).unbind(1), strict=True))
                step_captured = torch.cat([by_layer[i] for i in self.caches.capture_layers], dim=-1)
            hidden = rows if all_rows else None
            logits = greedy = None
            if inputs.num_sample_rows:
                logits = self.model.compute_logits(rows[inputs.sample_rows] if all_rows else rows)
                greedy = logits.argmax(-1)
            return self.output.sample(batch, inputs, greedy, logits, step_captured, hidden, plan, info, capture,
                                      preparer).result()

        if par.is_driver:
            return self.output.tracked(StepHandle(finish), info)
        par.defer(info.number, finish)  # a first-stage worker: when the driver finishes the step
        return StepHandle(lambda: NO_RESULT)
