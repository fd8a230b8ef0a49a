"""The vLLM side of `rollout.engine: vllm`: a process that holds a vLLM engine and answers
rlloom's requests, one pickled frame at a time, on the pipe it was started with.

It runs under the Python of an environment where vLLM is installed (`rollout.vllm_python`),
which need not have rlloom: vLLM pins its own transformers and friends, so rlloom keeps it
in a venv of its own. Hence this file imports only the standard library, torch and vLLM,
and is started by path (`python vllm_server.py ARGS_JSON`).

Requests (dicts) and replies:
- {"op": "generate", "prompts": [[ids]], "sampling": [{...}]} -> [(token_ids, logprobs,
  finish_reason)] per prompt, each with its own sampling settings (its own seed);
- {"op": "load", "path": DIR, "version": V} -> {"version": V, "seconds": s}: reloads every
  weight from the safetensors files in DIR (the trainer's latest), in place, and drops the
  prefix cache (keys and values of the old weights);
- {"op": "exit"}.
A failure is replied as {"error": "..."}; the engine keeps serving.
"""
from __future__ import annotations

import json
import os
import pickle
import struct
import sys
import time
import traceback
from typing import Any, BinaryIO


def read_frame(stream: BinaryIO) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the other side closed the pipe")
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(size))


def write_frame(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def main() -> None:
    args = json.loads(sys.argv[1])
    # replies go to the pipe rlloom reads; vLLM's own logs and prints go to stderr
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = os.fdopen(0, "rb")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args["kv_gib"]))  # whole GiB
    # a line per step drowns the run's progress; VLLM_LOGGING_LEVEL=INFO brings it back
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # one process: the engine's worker is reachable for in-place weight reloads
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=args["model"], dtype=args["dtype"], seed=args["seed"],
              max_model_len=args["max_model_len"], max_num_seqs=args["max_num_seqs"],
              enforce_eager=True, distributed_executor_backend="uni",
              logprobs_mode=args["logprobs_mode"], enable_prefix_caching=True,
              **args["gpu_memory"])
    worker = llm.llm_engine.model_executor.driver_worker.worker
    write_frame(replies, {"ready": True, "seconds": time.perf_counter() - t0})
    while True:
        request = read_frame(requests)
        op = request["op"]
        if op == "exit":
            return
        try:
            if op == "generate":
                params = [SamplingParams(**one, logprobs=0) for one in request["sampling"]]
                outs = llm.generate([TokensPrompt(prompt_token_ids=p)
                                     for p in request["prompts"]], params, use_tqdm=False)
                reply: Any = []
                for out in outs:
                    c = out.outputs[0]
                    ids = list(c.token_ids)
                    reply.append((ids, [c.logprobs[i][t].logprob for i, t in enumerate(ids)],
                                  c.finish_reason))
            elif op == "load":
                t = time.perf_counter()
                worker.reload_weights(weights_path=request["path"])
                llm.reset_prefix_cache()  # cached keys and values of the old weights
                reply = {"version": request["version"], "seconds": time.perf_counter() - t}
            else:
                reply = {"error": f"unknown request {op!r}"}
        except Exception:  # the engine stays up; the caller raises with this text
            reply = {"error": traceback.format_exc()}
        write_frame(replies, reply)


if __name__ == "__main__":
    main()
