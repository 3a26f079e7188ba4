"""Recipe "auto": formats per tensor under a byte budget the user gives (--budget-bytes), placed by
the measured per-role sensitivity (the allocator and its table: quantize/budget.py)."""
from __future__ import annotations

from mixqrt.errors import QuantError
from mixqrt.quantize.budget import (_GROUP, LADDER, SENSITIVITY, TIED, _unit_key, plan_formats,  # noqa: F401  (re-exported)
                                    plan_tensors)
from mixqrt.quantize.recipes import Recipe, get_recipe, parse_overrides, tensor_plan


def auto_recipe(source, budget_bytes: int, *, overrides=None, sensitivity=None) -> Recipe:
    """A Recipe named "auto" whose per-tensor table fits `budget_bytes` for this source."""
    if budget_bytes is None or int(budget_bytes) <= 0:
        raise QuantError(f"recipe auto needs a positive budget in bytes, got {budget_bytes!r}")
    base = get_recipe("2356")
    base = Recipe("auto", dict(base.table, norm="f32"), [], tie=True)
    plan = tensor_plan(source, base)
    per = plan_tensors(plan, int(budget_bytes), base.tie_source is not None, sensitivity)
    rec = Recipe("auto", dict(base.table, norm="f32"), parse_overrides(overrides), per_tensor=per, tie=True)
    rec.tie_source = base.tie_source
    return rec
