"""A request's LoRA adapter, with vLLM's names: LLM.generate(..., lora_request=LoRARequest(name, id, path))."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs with: `lora_name` names it (a --lora-modules name, or a new one with its
    `lora_path`: a PEFT adapter folder or hub id, loaded into a free slot on first use). `lora_int_id` is vLLM's
    numeric id, kept for its callers (Atlas keys adapters by name)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


# The engine's LoRA calls a front end may make (AsyncEngine.lora_call; EngineCore's methods of these names).
LORA_CALLS = ("load_lora_adapter", "unload_lora_adapter", "lora_adapters")
