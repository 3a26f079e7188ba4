"""Public ops used by the model graph. Signatures are those of mixqrt.ops_ref (the numpy spec);
the fast C kernels (mixqrt._kernels._ops) take over where they exist."""
from mixqrt.ops_ref import attention, embed, matmul, rmsnorm, rope, rope_cos_sin, silu_mul, softmax  # noqa: F401
