"""Data layer: tokenizers (built-in characters, Hugging Face, the Qwen chat format), built-in
tasks, prompt sources (JSONL, TFDS, reasoning-gym) and building a run's sources from its
settings, a resumable iterator, answer grading with a deadline (our numbers, math-verify) and
evaluation metrics.

tensorflow-datasets and reasoning-gym are imported only when their source is built.
"""

from sat_jax.data.evaluation import avg_at_k, evaluate, mean_pass_at_k, pass1, pass_at_k
from sat_jax.data.grading import Grader
from sat_jax.data.iterator import PromptIterator
from sat_jax.data.math_verify import (
    extract_answer,
    math_reward,
    math_reward_fn,
    normalize_answer,
    parse_number,
)
from sat_jax.data.prompt_sources import (
    JsonlSource,
    ListSource,
    PromptSource,
    TaskSource,
    TfdsSource,
    build_sources,
    check_prompts,
)
from sat_jax.data.reasoning_gym_source import (
    ReasoningGymSource,
    ReasoningGymTask,
    reasoning_gym_splits,
)
from sat_jax.data.tasks import (
    MIXTURE_TASKS,
    TASKS,
    AdditionTask,
    ArithmeticTask,
    Example,
    LongMultiplicationTask,
    MultiplicationTask,
    SortDigitsTask,
    Task,
    make_task,
    multiplication_trace,
    parse_mixture,
    task_from_config,
)
from sat_jax.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    IM_END,
    IM_START,
    PAD_ID,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    decode_response,
    load_tokenizer,
    qwen_chat_prompt,
    user_prompt,
)

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "IM_END",
    "IM_START",
    "MIXTURE_TASKS",
    "PAD_ID",
    "TASKS",
    "AdditionTask",
    "ArithmeticTask",
    "CharTokenizer",
    "Example",
    "HFTokenizer",
    "JsonlSource",
    "Grader",
    "ListSource",
    "LongMultiplicationTask",
    "MultiplicationTask",
    "PromptIterator",
    "PromptSource",
    "ReasoningGymSource",
    "ReasoningGymTask",
    "SortDigitsTask",
    "TaskSource",
    "Task",
    "Tokenizer",
    "TfdsSource",
    "avg_at_k",
    "build_sources",
    "check_prompts",
    "decode_response",
    "evaluate",
    "extract_answer",
    "load_tokenizer",
    "make_task",
    "math_reward",
    "math_reward_fn",
    "mean_pass_at_k",
    "multiplication_trace",
    "normalize_answer",
    "parse_mixture",
    "parse_number",
    "pass1",
    "pass_at_k",
    "qwen_chat_prompt",
    "reasoning_gym_splits",
    "task_from_config",
    "user_prompt",
]
