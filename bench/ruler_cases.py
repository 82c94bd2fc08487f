"""RULER's cases for `bench/ruler.py`: its generators in `nvidia-long-context-eval`, run as its `prepare.py` runs
them, each sample cut into the model's chat template (the task text as the user's message, the answer prefix
opening the assistant's turn) as token ids.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import random
import sys
from dataclasses import dataclass
from pathlib import Path

# Our name -> the entry of RULER's synthetic.yaml it runs.
TASKS = {
    "niah_single": "niah_single_2",
    "niah_multikey": "niah_multikey_1",
    "vt": "vt",
    "qa": "qa_2",
    "qa_squad": "qa_1",
}
# Below this RULER's generators can loop forever: the retry after a too-long case never shrinks past one step.
MIN_LENGTH = 2048


@dataclass(frozen=True)
class Case:
    id: int
    task: str
    length: int
    index: int  # RULER's sample index within (task, length)
    prompt_token_ids: list[int]
    max_tokens: int
    outputs: list[str]  # RULER's expected answers
    metric: str  # the RULER task whose metric scores it: niah, variable_tracking or qa


@contextlib.contextmanager
def _as_script(argv: list[str], aliases: dict[str, object]):
    """Run a RULER generator module's top level as its command line would: its argv, its sibling imports
    (`from constants import ...`) resolved to the package's modules, its progress output dropped."""
    saved_argv, saved = sys.argv, {k: sys.modules.get(k) for k in aliases}
    sys.argv = argv
    sys.modules.update(aliases)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        sys.argv = saved_argv
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def load_generators(model_dir: Path, needed: set[str]) -> tuple[dict, str]:
    """RULER's generator modules, imported with the model's tokenizer (RULER's `HFTokenizer` over `model_dir`);
    returns them and which sentence splitter the NIAH essay haystack uses."""
    try:
        import long_context_eval.data.synthetic.constants as constants
        import long_context_eval.data.tokenizer as tokenizer
    except ImportError as error:
        raise SystemExit(
            f"RULER's generators need `pip install --no-deps nvidia-long-context-eval` and "
            f"`pip install wonderwords nltk tenacity` ({error})"
        ) from None
    base = ["--save_dir", "unused", "--save_name", "unused", "--tokenizer_type", "hf", "--tokenizer_path"]
    argv = {
        "niah": [*base, str(model_dir), "--max_seq_length", "4096", "--tokens_to_generate", "128"],
        "variable_tracking": [*base, str(model_dir), "--max_seq_length", "4096"],
        "qa": [*base, str(model_dir), "--max_seq_length", "4096", "--tokens_to_generate", "32", "--template", "-"],
    }
    argv["qa"] += ["--dataset", "hotpotqa"]
    modules, splitter = {}, "nltk punkt_tab (RULER's)"
    for name in sorted(needed):
        with _as_script([name, *argv[name], "--num_samples", "1"], {"constants": constants, "tokenizer": tokenizer}):
            try:
                modules[name] = importlib.import_module(f"long_context_eval.data.synthetic.{name}")
            except ImportError as error:
                raise SystemExit(f"RULER's {name}.py needs `pip install wonderwords nltk tenacity` ({error})") from None
    if "niah" in modules:
        try:
            modules["niah"].sent_tokenize("One. Two.")
        except LookupError:
            from nltk.tokenize.punkt import PunktSentenceTokenizer

            modules["niah"].sent_tokenize = PunktSentenceTokenizer().tokenize
            splitter = "nltk Punkt, default parameters (punkt_tab data not installed)"
    return modules, splitter


def ruler_config(task: str) -> dict:
    """The task's settings as RULER's prepare.py makes them: synthetic.yaml's entry over constants.TASKS."""
    import long_context_eval
    import yaml
    from long_context_eval.data.synthetic.constants import TASKS as BASE

    entries = yaml.safe_load((Path(long_context_eval.__file__).parent / "synthetic.yaml").read_text())
    config = dict(entries[TASKS[task]])
    config.update(BASE[config["task"]])
    return config


def ruler_samples(module, config: dict, num_samples: int, length: int, seed: int) -> list[dict]:
    """`num_samples` RULER samples ({input, outputs, length}) of at most `length` tokens, seeded as a fresh run of
    the generator with `--random_seed seed` (its module state is reused, so it is seeded here again)."""
    import numpy as np

    args = module.args
    for key, value in config["args"].items():
        setattr(args, key, value)
    args.template = config["template"] + config["answer_prefix"]  # the 'base' model template, as prepare.py
    args.tokens_to_generate, args.max_seq_length = config["tokens_to_generate"], length
    args.num_samples, args.random_seed, args.pre_samples = num_samples, seed, 0
    random.seed(seed)
    np.random.seed(seed)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        if config["task"] == "niah":
            args.num_needle_k = max(args.num_needle_k, args.num_needle_q)
            return module.generate_samples(num_samples=num_samples, max_seq_length=length, save_dir=None)
        if config["task"] == "qa":
            return module.generate_samples(num_samples=num_samples, max_seq_length=length, save_dir=None)
        # variable_tracking's main: an in-context example of at most 500 tokens, then the samples.
        chains = {"num_chains": args.num_chains, "num_hops": args.num_hops}
        icl = module.sys_vartrack_w_noise_random(num_samples=1, max_seq_length=500, incremental=5, **chains)[0]
        return module.sys_vartrack_w_noise_random(num_samples, length, icl_example=icl, **chains)


def build_cases(model_dir: Path, tasks: list[str], lengths: list[int], num_samples: int, seed: int):
    """Every (length, sample, task) case as chat-templated token ids, shortest lengths first."""
    from rayapp.models.tokenizer import chat_token_ids, load_tokenizer

    tok = load_tokenizer(model_dir)
    configs = {t: ruler_config(t) for t in tasks}
    modules, splitter = load_generators(model_dir, {c["task"] for c in configs.values()})
    datasets = {"hotpotqa": (modules["qa"].QAS, modules["qa"].DOCS)} if "qa" in modules else {}  # read at import
    overhead = len(chat_token_ids(tok, [{"role": "user", "content": ""}]))
    by_cell: dict[tuple[str, int], list[dict]] = {}
    for task, config in configs.items():
        module = modules[config["task"]]
        if config["task"] == "qa":
            name = config["args"]["dataset"]
            if name not in datasets:
                path = Path(module.__file__).parent / "json" / f"{name}.json"
                datasets[name] = getattr(module, f"read_{name}")(str(path))
            module.QAS, module.DOCS = datasets[name]
        for length in lengths:
            by_cell[task, length] = ruler_samples(module, config, num_samples, length - overhead, seed)
    cases: list[Case] = []
    for length in lengths:
        for index in range(num_samples):
            for task, config in configs.items():
                sample = by_cell[task, length][index]
                lead = config["answer_prefix"].split("{")[0]  # the answer prefix's fixed start
                cut = sample["input"].rindex(lead)
                user, prefix = sample["input"][:cut], sample["input"][cut:].lstrip()
                ids = chat_token_ids(tok, [{"role": "user", "content": user}])
                ids += tok.encode(prefix, add_special_tokens=False)
                cases.append(
                    Case(len(cases), task, length, index, ids, config["tokens_to_generate"], sample["outputs"],
                         config["task"])
                )  # fmt: skip
    return cases, splitter
