"""The state of one sequence as it moves through the engine: host numbers only (no torch). What a request has on the
device (its seeded sampling generator, drafts left on the device or their distributions) is the model runner's,
keyed by request id (runtime/request_state.py)."""

from __future__ import annotations

import enum
import time

from atlas.outputs import CompletionOutput, Logprob, RequestMetrics
from atlas.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the request cannot go on (Request.error says why), e.g. its grammar allows no token

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


class Request:
    """One sequence: a prompt and the tokens generated for it so far.

    A user request with n > 1 becomes n of these (`index` 0..n-1, same `parent_id`); siblings share
    the prompt's KV pages (`share_from`).
    """

    def __init__(self, request_id: str, parent_id: str, index: int, prompt: str | None,
                 prompt_token_ids: list[int], params: SamplingParams, eos_token_ids: list[int],
                 arrival_time: float | None = None, group_id: str | None = None):
        self.request_id = request_id
        self.parent_id = parent_id
        # The user request it belongs to for fair slots (scheduler.py): its parent, or the API call whose prompts
        # each became a parent.
        self.group_id = group_id or parent_id
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = [] if params.ignore_eos else list(eos_token_ids)
        self.stop_token_ids: list[int] = self.eos_token_ids + list(params.stop_token_ids)
        self.stop_token_set = frozenset(self.stop_token_ids)  # (checked for every generated token)
        # Output tokens past which the request ends on length (max_tokens), if it sets one.
        self.max_output_tokens = params.max_tokens if params.max_tokens is not None else 1 << 62
        # The sampler's penalties count the output tokens: the runner keeps them, sent as they come (its first
        # `runner_outputs` it has; StepBatch records).
        self.penalized = params.needs_output_history
        self.runner_outputs = 0
        # Its StepBatch record for a step that brings the runner nothing new (no tokens, no page change, no output
        # tokens, no prompt logprobs: a decode step behind one whose token is still on the device), made once and
        # shared by every such step (scheduler.py).
        self.idle_record = None
        # The seed of this sequence's own sampling generator (the runner's), if the request sets one: sample n of a
        # seeded request draws from seed + n.
        self.seed = params.seed + index if params.seed is not None else None
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.arrival_order = 0  # (set by the scheduler: ties of the priority policy go to the earlier)
        # (set by the scheduler: fair rows run the least recently scheduled first; (step, rank within its picks))
        self.last_scheduled = (0, 0)
        self.stop_reason: int | str | None = None

        # KV state (owned by the scheduler / KVCacheManager).
        # Positions whose KV this step or an earlier one computes: advanced when a step is scheduled,
        # wound back for drafts the verification rejects.
        self.num_computed_tokens = 0
        # Tokens sampled on the device whose values the host has not read yet: asynchronous scheduling
        # schedules the next step before the last one's token is known (at most one when a step is
        # scheduled; two between scheduling a step and reading back the one before).
        self.num_pending_tokens = 0
        self.page_ids: list[int] = []
        # The runner's copy of page_ids (KVCacheManager.table_change hands each step its change): its first
        # `runner_pages_valid` entries are page_ids' as they are, out of the `runner_pages` it holds.
        self.runner_pages = 0
        self.runner_pages_valid = 0
        self.page_hashes: list[bytes] = []
        self.num_registered_pages = 0
        # Leading pages handed back because they fell out of every layer's sliding window (their page_ids
        # entries then read NULL_PAGE; engine/kv_cache.py).
        self.num_released_pages = 0
        # Models whose windowed layers keep a page pool of their own (engine/kv_groups.py): this request's table
        # there (a WindowTable, made by the page manager on first use), else None.
        self.window_table = None
        self.num_cached_tokens = 0  # prefix-cache hit at first scheduling
        self.share_from: Request | None = None  # sibling whose prompt pages to share
        # Models with recurrent state: this request's state slot while it runs (scheduler.StateSlotPool), else None.
        self.state_slot: int | None = None
        # ... and the snapshots it saved its state into at page ends, until those pages are registered in the prefix
        # cache: (page index, snapshot id) (KVCacheManager.snapshot_point); the cached pages its prompt's lookup found
        # before the hit was cut back to a page with a snapshot (its state is saved where they end, too).
        self.pending_snapshots: list[tuple[int, int]] = []
        # ... and how many rows of its last verify step its next step replays into its slot, restored first from the
        # backup taken before that step (some drafts were rejected: the state had advanced past them); 0: none.
        self.state_replay = 0
        self.num_chain_pages = 0
        self.spec_token_ids: list[int] = []  # drafts to verify in the next step
        self.spec_num_real = 0  # drafts of spec_token_ids that are real (the rest pad a uniform step)
        # Their values are still on the device (the runner's; Draft.device_tokens): spec_token_ids holds placeholders.
        self.spec_on_device = False
        # Structured outputs: the grammar state (atlas.structured.RequestGrammar), advanced by the engine core.
        self.grammar = None
        self.error: str | None = None  # why it ended with FINISHED_ERROR
        # --enable-lora: the adapter slot + 1 its steps read (0: the base model), and the adapter's prefix-cache key
        # (engine/lora.py: its pages are not the base model's, nor another adapter's).
        self.lora_slot = 0
        self.lora_key: str | None = None
        self.embedding: list[float] | None = None  # --runner pooling: the pooled vector, once the prompt is computed

        # Output state (owned by the engine core).
        self.output_text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        # Entry i is for prompt token i; filled as the prompt's chunks are computed.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None and index == 0 else None)
        self.detokenizer = None  # set by the engine when a tokenizer is loaded
        now = time.time()
        self.metrics = RequestMetrics(arrival_time=arrival_time or now, received_time=now)
        self.last_token_time: float | None = None  # (the scheduler's, for the inter-token latencies)

    def clear_drafts(self) -> None:
        self.spec_token_ids = []
        self.spec_on_device = False

    # ------------------------------------------------------------------ sizes
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def completion_output(self, text: str) -> CompletionOutput:
        finish = self.status.value if self.is_finished else None
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=finish,
            stop_reason=self.stop_reason,
            error=self.error,
        )
