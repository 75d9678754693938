"""Stage 5: the serving engine — continuous batching, chunked prefill, preemption.

    request.py     a request's state (tokens computed, output, timestamps) and RequestOutput
    scheduler.py   which requests compute how many tokens each step (continuous or static)
    runner.py      all scheduled tokens packed into one forward pass over the paged KV cache
    llm_engine.py  EngineConfig; LLMEngine: add_request / step / abort_request / stats
    llm.py         LLM: generate(prompts) and chat(conversations) for scripts and notebooks
"""
from .llm import LLM
from .llm_engine import EngineConfig, LLMEngine
from .request import RequestMetrics, RequestOutput, Status
from .scheduler import Scheduler

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestMetrics", "RequestOutput", "Scheduler", "Status"]
