"""Expert parallelism: process groups (`groups`), the EP link with an optional modelled
inter-node cost (`comm`), expert-parallel MoE with two-way microbatching (`ep_moe`) and a local
multi-process launcher (`local_launch`)."""
from moespec.parallel.comm import Collectives, CommStream, LinkModel, ThrottledCollectives
from moespec.parallel.ep_moe import DeepEPExperts, EPExperts, EPRuntime, ep_experts_factory, split_point
from moespec.parallel.groups import (ParallelContext, ParallelError, destroy, init_parallel, parse_nodelist,
                                     read_launch_env)

__all__ = ["Collectives", "CommStream", "DeepEPExperts", "EPExperts", "EPRuntime", "LinkModel", "ParallelContext",
           "ParallelError", "ThrottledCollectives", "destroy", "ep_experts_factory",
           "init_parallel", "parse_nodelist", "read_launch_env", "split_point"]
