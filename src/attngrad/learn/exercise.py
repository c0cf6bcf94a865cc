"""Write the attention-backward exercise (the course chapter's Step 4) into a folder.

``write_exercise(DIR)`` writes ``attention_exercise.py`` -- four TODO functions
(`value_gradient`, `probability_gradient`, `softmax_backward`,
`query_key_gradients`) under a complete ``CustomAttention`` autograd.Function
with the chapter's input contract -- and a README.md with the task, the
formulas and how to grade it (``attngrad grade attention_exercise.py``).
In the learner's language: ``lang=None`` (the default) takes Chinese where the
locale asks for it (``LC_ALL``, ``LC_MESSAGES``, ``LANG`` or ``LANGUAGE`` starting
with ``zh``) and English everywhere else; ``lang="zh"`` or ``"en"`` chooses.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["LANGS", "SKELETON", "locale_lang", "write_exercise"]

LANGS = ("en", "zh")
SKELETON = "attention_exercise.py"

_TEXT: dict[str, dict[str, str]] = {
    "zh": {
        "module": "Attention 反向传播练习：补全四个局部梯度函数（TODO 1-4）。\n\n"
        "前向：S = scale·Q·Kᵀ，P = softmax(S)，O = P·V，其中 scale = 1/√d。\n"
        "完成后运行 `attngrad grade attention_exercise.py` 评分。",
        "v": "TODO 1：Value 分支的梯度。\n\n"
        "    因为 O = P·V，所以 dV = Pᵀ·dO。\n\n"
        "    p:    [B, Nq, Nk]  前向的概率矩阵\n"
        "    dout: [B, Nq, d]   输出 O 的梯度\n"
        "    返回 dv: [B, Nk, d]，与 V 同形状。",
        "v_todo": "TODO 1: 请由 p 和 dout 计算 dV",
        "p": "TODO 2：概率矩阵 P 的梯度。\n\n"
        "    因为 O = P·V，所以 dP = dO·Vᵀ。\n\n"
        "    dout: [B, Nq, d]\n"
        "    v:    [B, Nk, d]\n"
        "    返回 dp: [B, Nq, Nk]，与 P 同形状。",
        "p_todo": "TODO 2: 请由 dout 和 v 计算 dP",
        "s": "TODO 3：穿过 Softmax（沿最后一维）。\n\n"
        "    dS = P∘(dP − rowsum(P∘dP))，rowsum 对每一行（最后一维）求和并保留该维。\n"
        "    每一行的 dS 之和应为 0。\n\n"
        "    p, dp: [B, Nq, Nk]\n"
        "    返回 ds: [B, Nq, Nk]。",
        "s_todo": "TODO 3: 请由 p 和 dp 计算 dS",
        "qk": "TODO 4：缩放点积回传到 Query 和 Key。\n\n"
        "    因为 S = scale·Q·Kᵀ，所以 dQ = scale·dS·K，dK = scale·dSᵀ·Q。\n"
        "    两条支路都带同一个 scale。\n\n"
        "    ds: [B, Nq, Nk]，q: [B, Nq, d]，k: [B, Nk, d]，scale: 1/√d\n"
        "    返回 (dq, dk)，形状分别与 q、k 相同。",
        "qk_todo": "TODO 4: 请计算 dQ 和 dK",
        "cls": "教学版缩放点积 Attention（单头、无 mask、无 dropout），backward 由上面四个函数组成。\n\n"
        "    q, k, v: [B, N, d]，dtype 与 device 一致 -> O: [B, N, d]。本类已完整给出，无需修改。",
        "e_ndim": "q、k、v 必须是 [batch, seq_len, head_dim] 三维张量",
        "e_seq": "q、k、v 的 batch 和序列长度必须一致",
        "e_dim": "q、k、v 的 head_dim 必须一致",
        "e_dev": "q、k、v 必须位于同一 device",
        "e_float": "q、k、v 必须是浮点张量（可用 .float() 转换）",
        "e_dtype": "q、k、v 必须使用相同 dtype",
        "e_dout": "dout 必须与 Attention 输出形状相同",
    },
    "en": {
        "module": "Attention backward exercise: fill in the four local gradients (TODO 1-4).\n\n"
        "Forward: S = scale·Q·Kᵀ, P = softmax(S), O = P·V with scale = 1/√d.\n"
        "When done, grade it with `attngrad grade attention_exercise.py`.",
        "v": "TODO 1: the gradient of the value branch.\n\n"
        "    Since O = P·V, dV = Pᵀ·dO.\n\n"
        "    p:    [B, Nq, Nk]  the forward's probabilities\n"
        "    dout: [B, Nq, d]   the gradient of the output O\n"
        "    returns dv: [B, Nk, d], shaped like V.",
        "v_todo": "TODO 1: compute dV from p and dout",
        "p": "TODO 2: the gradient of the probabilities P.\n\n"
        "    Since O = P·V, dP = dO·Vᵀ.\n\n"
        "    dout: [B, Nq, d]\n"
        "    v:    [B, Nk, d]\n"
        "    returns dp: [B, Nq, Nk], shaped like P.",
        "p_todo": "TODO 2: compute dP from dout and v",
        "s": "TODO 3: back through the softmax (along the last dim).\n\n"
        "    dS = P∘(dP − rowsum(P∘dP)); rowsum sums each row (the last dim) and keeps that dim.\n"
        "    Every row of dS sums to 0.\n\n"
        "    p, dp: [B, Nq, Nk]\n"
        "    returns ds: [B, Nq, Nk].",
        "s_todo": "TODO 3: compute dS from p and dp",
        "qk": "TODO 4: back through the scaled dot product to the queries and keys.\n\n"
        "    Since S = scale·Q·Kᵀ, dQ = scale·dS·K and dK = scale·dSᵀ·Q.\n"
        "    Both branches carry the same scale.\n\n"
        "    ds: [B, Nq, Nk], q: [B, Nq, d], k: [B, Nk, d], scale: 1/√d\n"
        "    returns (dq, dk), shaped like q and k.",
        "qk_todo": "TODO 4: compute dQ and dK",
        "cls": "Teaching scaled-dot-product attention (one head, no mask, no dropout) whose\n"
        "    backward is built from the four functions above.\n\n"
        "    q, k, v: [B, N, d] of one dtype and device -> O: [B, N, d].  Given complete; leave it.",
        "e_ndim": "q, k, v must be 3-D [batch, seq_len, head_dim] tensors",
        "e_seq": "q, k, v must share batch and seq_len",
        "e_dim": "q, k, v must share head_dim",
        "e_dev": "q, k, v must be on one device",
        "e_float": "q, k, v must be floating point (convert them with .float())",
        "e_dtype": "q, k, v must share a dtype",
        "e_dout": "dout must have the attention output's shape",
    },
}

_SKELETON = '''"""{module}
"""

import math

import torch
import torch.nn.functional as F


def value_gradient(p, dout):
    """{v}
    """
    raise NotImplementedError("{v_todo}")


def probability_gradient(dout, v):
    """{p}
    """
    raise NotImplementedError("{p_todo}")


def softmax_backward(p, dp):
    """{s}
    """
    raise NotImplementedError("{s_todo}")


def query_key_gradients(ds, q, k, scale):
    """{qk}
    """
    raise NotImplementedError("{qk_todo}")


class CustomAttention(torch.autograd.Function):
    """{cls}
    """

    @staticmethod
    def forward(ctx, q, k, v):
        if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
            raise ValueError("{e_ndim}")
        if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
            raise ValueError("{e_seq}")
        if q.size(-1) != k.size(-1) or v.size(-1) != q.size(-1):
            raise ValueError("{e_dim}")
        if q.device != k.device or k.device != v.device:
            raise ValueError("{e_dev}")
        if not (q.is_floating_point() and k.is_floating_point() and v.is_floating_point()):
            raise TypeError("{e_float}")
        if q.dtype != k.dtype or k.dtype != v.dtype:
            raise TypeError("{e_dtype}")
        scale = 1.0 / math.sqrt(q.size(-1))
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # S: [B, N, N]
        p = F.softmax(scores, dim=-1)  # P: [B, N, N]
        out = torch.matmul(p, v)  # O: [B, N, d]
        ctx.save_for_backward(q, k, v, p)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, p = ctx.saved_tensors
        if dout.shape != q.shape:
            raise ValueError("{e_dout}")
        dv = value_gradient(p, dout)  # TODO 1
        dp = probability_gradient(dout, v)  # TODO 2
        ds = softmax_backward(p, dp)  # TODO 3
        dq, dk = query_key_gradients(ds, q, k, ctx.scale)  # TODO 4
        return dq, dk, dv
'''

_README = {
    "zh": """# 练习：Attention 反向传播与自定义 Autograd

`attention_exercise.py` 中的 `CustomAttention` 已经写好了前向、输入检查和 backward 的调用顺序；
你的任务是补全 backward 用到的四个局部梯度函数（TODO 1-4），把每个 `raise NotImplementedError` 换成实现。

前向（每个 batch 一份，scale = 1/√d）：

    S = scale·Q·Kᵀ      P = softmax(S, dim=-1)      O = P·V

从输出梯度 dO 出发，反向依次是：

| TODO | 函数 | 公式 | 结果形状 |
|------|------|------|----------|
| 1 | `value_gradient(p, dout)` | dV = Pᵀ·dO | 与 V 相同 [B, Nk, d] |
| 2 | `probability_gradient(dout, v)` | dP = dO·Vᵀ | 与 P 相同 [B, Nq, Nk] |
| 3 | `softmax_backward(p, dp)` | dS = P∘(dP − rowsum(P∘dP)) | 与 P 相同 |
| 4 | `query_key_gradients(ds, q, k, scale)` | dQ = scale·dS·K，dK = scale·dSᵀ·Q | 与 q、k 相同 |

提示：转置只作用于最后两维（`x.transpose(-2, -1)` 或 `x.mT`）；rowsum 沿最后一维求和并保留该维
（`keepdim=True`）；Q 和 K 两条支路都带同一个 scale。

## 评分

    attngrad grade attention_exercise.py

评分器在子进程中导入你的文件：四个函数各自单独评分（输入都来自参考实现，一处错误不会连带后面的
阶段），探针覆盖非方阵、方阵、多 batch、d ≠ N 与 d = N；然后整体检查 `CustomAttention`
（前向、反向、float64 gradcheck 与输入契约）。出错的阶段会给出错误类型的编号与提示。
`--json PATH` 另存结果，`--timeout S` 设置每个阶段的时限。全部通过时退出码为 0。
""",
    "en": """# Exercise: attention backward with a custom autograd.Function

`CustomAttention` in `attention_exercise.py` is complete: the forward, the input checks and the
order in which backward calls its helpers.  Your task is the four local gradients it calls
(TODO 1-4): replace each `raise NotImplementedError` with the computation.

Forward (per batch, scale = 1/√d):

    S = scale·Q·Kᵀ      P = softmax(S, dim=-1)      O = P·V

Backward, starting from the output gradient dO:

| TODO | function | formula | result shape |
|------|----------|---------|--------------|
| 1 | `value_gradient(p, dout)` | dV = Pᵀ·dO | like V, [B, Nk, d] |
| 2 | `probability_gradient(dout, v)` | dP = dO·Vᵀ | like P, [B, Nq, Nk] |
| 3 | `softmax_backward(p, dp)` | dS = P∘(dP − rowsum(P∘dP)) | like P |
| 4 | `query_key_gradients(ds, q, k, scale)` | dQ = scale·dS·K, dK = scale·dSᵀ·Q | like q and k |

Hints: transpose only the last two dims (`x.transpose(-2, -1)` or `x.mT`); rowsum sums along
the last dim and keeps it (`keepdim=True`); the query and key branches carry the same scale.

## Grading

    attngrad grade attention_exercise.py

The grader imports your file in a child process.  Each function is graded on its own, fed
the reference's correct inputs (so one mistake does not spill into later stages), on probes
that are non-square, square, batched, with d != N and d = N; then `CustomAttention` as a
whole (forward, backward, float64 gradcheck and the input contract).  A failing stage names
the mistake and gives a hint.  `--json PATH` also writes the results, `--timeout S` sets each
stage's time limit.  The exit code is 0 when every stage passes.
""",
}


def locale_lang(environ: Mapping[str, str] | None = None) -> str:
    """Chinese ("zh") where the locale asks for it, else English ("en").

    The variables are read as gettext reads them: the first of ``LANGUAGE`` (a
    colon-separated list, its first entry), ``LC_ALL``, ``LC_MESSAGES`` and ``LANG``
    that is set and not empty decides, so ``LC_ALL=C`` over ``LANG=zh_CN.UTF-8`` is
    English, as every other program on the machine would speak.

    >>> locale_lang({"LANG": "zh_CN.UTF-8"}), locale_lang({"LANG": "de_DE.UTF-8"}), locale_lang({})
    ('zh', 'en', 'en')
    """
    env = os.environ if environ is None else environ
    for name in ("LANGUAGE", "LC_ALL", "LC_MESSAGES", "LANG"):
        value = env.get(name, "").split(":")[0]
        if value:
            return "zh" if value.lower().startswith("zh") else "en"
    return "en"


def skeleton(lang: str | None = None) -> str:
    """The exercise module's source in ``lang`` (None: `locale_lang`)."""
    return _SKELETON.format(**_TEXT[_lang(lang)])


def readme(lang: str | None = None) -> str:
    """The exercise's README.md in ``lang`` (None: `locale_lang`)."""
    return _README[_lang(lang)]


def _lang(lang: str | None) -> str:
    if lang is None:
        return locale_lang()
    if lang not in LANGS:
        raise ValueError(
            f"lang={lang!r} is not a language of the exercise; choose one of "
            f"{', '.join(map(repr, LANGS))}, or None for the locale's"
        )
    return lang


def write_exercise(
    directory: str | os.PathLike[str], lang: str | None = None, force: bool = False
) -> list[Path]:
    """Write the skeleton and README.md into ``directory`` (created if missing).

    lang: "en", "zh", or None (the default) for the locale's (`locale_lang`).

    Refuses, with FileExistsError naming the file, to overwrite an existing one
    unless ``force``.  Returns the paths written.
    """
    files = {SKELETON: skeleton(lang), "README.md": readme(lang)}
    root = Path(directory)
    paths = [root / name for name in files]
    if not force:
        for path in paths:
            if path.exists():
                raise FileExistsError(
                    f"{path} already exists; pass --force (force=True) to overwrite it"
                )
    root.mkdir(parents=True, exist_ok=True)
    for path, text in zip(paths, files.values(), strict=True):
        path.write_text(text, encoding="utf-8")
    return paths
