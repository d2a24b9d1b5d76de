"""The routed experts' up-projection epilogue on QuACK's GEMM frontend (moe/quack.py).

Imported only where QuACK loads: it imports QuACK's CUTLASS DSL. A module of its own because
QuACK's compile workers find an epilogue by its module and name, and its kernel cache keys on
the function's source.
"""

from quack.activation import swiglu
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.math import pack, unpack
from quack.epilogue.ops import ColVecLoad


@gemm_epilogue(outputs=("postact",), ops={"p": ColVecLoad("p")}, mode="acc_pair")
def swiglu_times_p(acc, p):
    """acc: a row's (gate, up) pairs (w13's rows alternate gate and up), fp32; p: the row's
    routing weight. D keeps the pairs (the gated backward recomputes the SwiGLU from them);
    postact = silu(gate) * up * p, half of D's width."""
    gate, up = unpack(acc)
    return {"D": pack(gate, up), "postact": swiglu(gate, up) * p}
