"""The sharding plan of ``tpu_train.models.Mixtral``: the Llama plan, and the experts split
over the ``expert`` mesh axis.

==============================  ====================================  ==========================
parameter                       spec                                  why
==============================  ====================================  ==========================
``feed_forward.w{1,3}``         ``(expert, (tensor, fsdp), None)``    each device holds
                                                                      ``n_experts / expert``
                                                                      experts, column-parallel
``feed_forward.w2``             ``(expert, fsdp, tensor)``            row-parallel
``feed_forward.gate.weight``    replicated                            the router is tiny
everything else                 as in ``llama_plan``                  replicated over ``expert``
==============================  ====================================  ==========================

The stacked expert weights are ``[n_experts, out, in]``. The batch is split over ``expert``
as well as ``(data, fsdp)`` (``BATCH_AXES``), so the attention of an expert-parallel mesh does
no redundant work; XLA moves the tokens to their experts' devices and back (the collectives
follow from these specs). Stored weights are gathered over ``fsdp`` only where used
(``compute_sharding``): each device keeps computing with its own experts.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from .llama_plan import llama_plan, llama_rules
from .plans import ShardingPlan

__all__ = ["mixtral_plan"]


def mixtral_plan(*, fsdp: bool = True, tensor: bool = True) -> ShardingPlan:
    """The Mixtral plan; ``fsdp``/``tensor`` as in :func:`llama_plan`."""
    f = "fsdp" if fsdp else None
    t = "tensor" if tensor else None
    columns = tuple(a for a in (t, f) if a) or None
    experts = [
        (r"(^|\.)feed_forward\.gate\.weight$", P()),
        (r"(^|\.)feed_forward\.w[13]$", [P("expert", columns, None), P("expert", t, f)]),
        (r"(^|\.)feed_forward\.w2$", P("expert", f, t)),
    ]
    base = llama_plan(fsdp=fsdp, tensor=tensor)
    return ShardingPlan(experts + llama_rules(fsdp=fsdp, tensor=tensor),
                        activations=base.activations, activation_rule=base.activation_rule,
                        name=base.name.replace("llama_plan", "mixtral_plan"))
