"""The torch.distributed runtime: executes training-step Programs (gloo on CPU, NCCL on GPU).

``run(model, strategy, steps=...)`` compiles, launches local processes and trains;
``run_program(program)`` executes a compiled or saved Program; ``Runtime`` is one rank's runtime
(process-group cache, state store, interpreter, profiler); ``launch_local`` starts ranks;
``run_live(model, strategy, steps=..., switches=[...])`` trains a live job that hot-switches;
``run_user_model(factory, strategy, ...)`` trains the user's own torch model annotated with regions.
Replaying a preemption trace against a live job is :mod:`parashift.replay` (it uses ``exec`` and ``search``).
"""
from .groups import Worlds
from .launch import RankContext, launch_local, under_torchrun
from .reference import OptimConfig, make_batch, reference_train
from .runtime import RunResult, Runtime, compile_program, load_plan, run, run_program
from .switch import LiveResult, run_live
from .user_model import UserModel, compile_user_model, run_user_model

__all__ = ["run", "run_program", "compile_program", "load_plan", "Runtime", "RunResult", "Worlds",
           "RankContext", "launch_local", "under_torchrun", "OptimConfig", "make_batch", "reference_train",
           "run_live", "LiveResult", "run_user_model", "compile_user_model", "UserModel"]
