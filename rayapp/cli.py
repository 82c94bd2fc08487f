"""`rayapp chat`, `rayapp generate --prompt ...`, `rayapp prepare-model [name]`, `rayapp cpu-info`,
`rayapp kv-transfer-config --model-id ...`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import uuid

from rayapp.config import KVTierConfig
from rayapp.drivers.async_engine import AsyncLLMEngine
from rayapp.engine.request import EngineRequest
from rayapp.engine.sampling_params import SamplingParams
from rayapp.kernels.cpu import detect, plan_for
from rayapp.models.gguf import SHIPPED
from rayapp.models.loader import resolve_model
from rayapp.models.tokenizer import chat_token_ids


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="repo id, folder, .gguf or shipped model name; default: SmolLM2-135M-Instruct"
    )
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--device", default="cpu", help="cpu | cuda[:N] | npu[:N]")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)


async def _stream(engine: AsyncLLMEngine, request: EngineRequest) -> str:
    text = ""
    async for out in engine.generate(request):
        delta = out.outputs[0].delta_text
        text += delta
        print(delta, end="", flush=True)
    print()
    return text


async def _chat(engine: AsyncLLMEngine, params: SamplingParams) -> None:
    messages: list[dict[str, str]] = []
    loop = asyncio.get_running_loop()
    print("Chat with the model; an empty line or Ctrl-D quits.")
    while True:
        line = await loop.run_in_executor(None, _read_line)
        if not line:
            return
        messages.append({"role": "user", "content": line})
        ids = chat_token_ids(engine.engine.tokenizer, messages)
        reply = await _stream(engine, EngineRequest(uuid.uuid4().hex, ids, sampling=params))
        messages.append({"role": "assistant", "content": reply})


def _read_line() -> str:
    try:
        return input("> ").strip()
    except EOFError:
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rayapp")
    sub = parser.add_subparsers(dest="command", required=True)
    _engine_args(sub.add_parser("chat", help="interactive multi-turn chat, streamed"))
    gen = sub.add_parser("generate", help="complete one prompt")
    _engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    prepare = sub.add_parser("prepare-model", help="make a model ready in the local cache and print its folder")
    prepare.add_argument(
        "model",
        nargs="?",
        default=None,
        help=f"a shipped model ({', '.join(m.aliases[0] for m in SHIPPED)}), a .gguf file or a repo id; "
        "default: the shipped SmolLM2-135M-Instruct",
    )
    info = sub.add_parser("cpu-info", help="this CPU's features and the dtype and kernels rayapp's engine picks")
    info.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    _tier_args(sub.add_parser("kv-transfer-config", help="print vLLM's kv_transfer_config JSON for rayapp's KV tier"))
    args = parser.parse_args(argv)

    if args.command == "kv-transfer-config":
        return _kv_transfer_config(args)
    if args.command == "prepare-model":
        try:
            print(resolve_model(args.model))
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        return 0
    if args.command == "cpu-info":
        return _cpu_info(args.dtype)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
        )
        engine = AsyncLLMEngine.from_options(model=args.model, dtype=args.dtype, device=args.device)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        if args.command == "chat":
            asyncio.run(_chat(engine, params))
        elif args.raw:
            asyncio.run(_stream(engine, engine.engine.request(uuid.uuid4().hex, args.prompt, params)))
        else:
            ids = chat_token_ids(engine.engine.tokenizer, [{"role": "user", "content": args.prompt}])
            asyncio.run(_stream(engine, EngineRequest(uuid.uuid4().hex, ids, sampling=params)))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()
    return 0


def _tier_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-id", required=True, help="the model's name in the blocks' hashes, the same on every engine sharing it"
    )
    parser.add_argument(
        "--dsn", default=None, help="the catalog's PostgreSQL / openGauss DSN; default: RAYAPP_KVTIER_DSN, else the "
        "embedded database of the Ray cluster at --ray-address, started there if it is not running",
    )  # fmt: skip
    parser.add_argument(
        "--ray-address", default=None, help="the Ray cluster vLLM's workers join to hold the blocks; default: their "
        "ray.init() default (RAY_ADDRESS, or the cluster `ray start` started on their machine); 'local': a "
        "private one-node Ray per worker (needs --dsn)",
    )  # fmt: skip
    parser.add_argument("--data-dir", default=None, help="data directory of the embedded database (not with --dsn)")
    parser.add_argument("--capacity-bytes", type=int, default=KVTierConfig.capacity_bytes, help="store bytes per node")
    parser.add_argument(
        "--min-load-tokens", type=int, default=KVTierConfig.min_load_tokens,
        help="load tier blocks only when they cover this many more prompt tokens than vLLM's own cache",
    )  # fmt: skip


def _kv_transfer_config(args: argparse.Namespace) -> int:
    """Print the JSON for `vllm serve --kv-transfer-config` (and Ray Serve LLM's engine_kwargs.kv_transfer_config)."""
    from rayapp.integrations.stock_vllm import kv_transfer_config_json

    given = {k: v for k, v in (("dsn", args.dsn), ("data_dir", args.data_dir)) if v is not None}
    try:
        tier = KVTierConfig.from_env(
            enabled=True, capacity_bytes=args.capacity_bytes, min_load_tokens=args.min_load_tokens, **given
        )
        if tier.dsn is not None:
            config = kv_transfer_config_json(
                tier.dsn, args.model_id, ray_address=args.ray_address, capacity_bytes=tier.capacity_bytes,
                min_load_tokens=tier.min_load_tokens,
            )  # fmt: skip
        elif args.ray_address == "local":
            raise ValueError("--ray-address local needs --dsn: the embedded database lives in a Ray cluster")
        else:
            config = _embedded_database_config(tier, args)
    except (ValueError, ConnectionError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(config))
    return 0


def _embedded_database_config(tier: KVTierConfig, args: argparse.Namespace) -> dict:
    """The config naming the Ray cluster's embedded database (a detached actor: it outlives this command)."""
    import ray

    from rayapp.integrations.stock_vllm import cluster_kv_transfer_config_json

    try:
        ray.init(address=args.ray_address or "auto", log_to_driver=False, logging_level=logging.WARNING)
    except ConnectionError as error:
        raise ConnectionError(
            f"{error}; start a Ray cluster on this machine (`ray start --head`), name one with --ray-address, or "
            "give the catalog's --dsn"
        ) from None
    try:
        return cluster_kv_transfer_config_json(tier, args.model_id)
    finally:
        ray.shutdown()


def _cpu_info(dtype: str) -> int:
    cpu = detect()
    print(f"CPU: {cpu.describe()}")
    try:
        plan = plan_for(dtype, cpu)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"dtype: {plan.dtype_name}, {'oneDNN-packed' if plan.prepack else 'torch'} linears ({plan.reason})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
