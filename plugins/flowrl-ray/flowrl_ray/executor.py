"""The Ray executor: each device of the plan is a Ray actor running one `Worker`.

Without an address it starts a private Ray on this machine (``address="local"``) with the CPUs
or GPUs the plan needs, and shuts it down at the end (``ray.shutdown()`` only; never ``ray
stop``, which would stop every Ray on the machine). With an address (``--address``) it joins
that cluster. Ranks are placed by node (`flowrl_ray.nodes`): device ``i`` of the plan lives on
plan node ``i // devices_per_node``, plan node ``k`` on the cluster's ``k``-th node (head first, then by
node id), and the ranks of one device group on one node share a placement group (STRICT_PACK, pinned
to that node). ``workers.json`` records every rank's node. Before any model is built, every worker
proves it sees the run folder (`flowrl_ray.shared`): checkpoints are written there by rank 0 and read
back by every rank. The workers form one torch.distributed process group (gloo on CPU, NCCL on GPU)
that meets at rank 0's node, with a subgroup per device group and a channel per weight sync.

A worker that dies (its process killed, its node lost) stops the attempt at once: the driver waits
on every call with ``ray.wait`` and turns a dead actor into a `WorkerLostError` naming the worker,
its group, its pid, the iteration and the task; then it kills the other workers (which would
otherwise wait in a collective) and removes the placement groups. Inside a `RayExecutor.session`
(the restarts of one run, `flowrl.runtime.recovery`) Ray stays up for the next attempt, and
`RayExecutor.devices` says what it could place; the private Ray is shut down when the session ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from flowrl.backends.local.device import machine as local_machine
from flowrl.backends.local.executor import LOCAL_NUMERICS
from flowrl.contract import BackendError, Capabilities, FlowRLError, WorkerLostError
from flowrl.runtime.executor import PlanExecutor
from flowrl.runtime.worker import Worker

if TYPE_CHECKING:
    from flowrl.contract import ClusterNode, ExecutionPlan, Graph, HardwareSpec, RunConfig
    from flowrl.runtime.schedule import Schedule

#: Seconds to wait for the cluster to grant a placement group before saying it lacks the devices.
PLACEMENT_TIMEOUT_S = 60.0
#: Seconds to wait for a TCP connection to the GCS port of ``--address host:port`` before saying nothing is there.
CONNECT_TIMEOUT_S = 10.0
#: Seconds between liveness checks while a call runs.
POLL_S = 0.5
#: Seconds a node that lost a worker has to run a probe task before it counts as gone: a crashed node stays
#: alive in Ray's node table until its heartbeats time out (tens of seconds), and nothing can be placed on it.
PROBE_S = 15.0


def machine(cfg: RunConfig) -> HardwareSpec:
    """This machine as the planner sees it (``--cluster cpu:N`` cuts it into N devices)."""
    return local_machine(cfg)


class RayWorker(Worker):
    """A worker as a Ray actor."""

    def endpoint(self) -> tuple[str, int]:
        """This worker's node address and a free port on it: where the process group meets."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def node_id(self) -> str:
        """The Ray node this worker runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def probe_folder(self, folder: str, token: str, rank: int, node: str) -> str | None:
        """The run folder's check from this worker (`flowrl_ray.shared`): why it is not shared, or None."""
        from flowrl_ray.shared import worker_side

        return worker_side(folder, token, rank, node)


class RayExecutor(PlanExecutor):
    """Every device group of the plan as Ray actors: FSDP2 data-parallel training, generation
    replicas, planned weight sync."""

    capabilities = Capabilities(
        max_devices=None,
        placements=("colocate", "split", "standalone", "disaggregated"),
        rollout_modes=("sync", "one_step_off", "async"),
        partial_rollouts=True,
        streaming=True,
        weight_sync=("reshard", "full", "bucketed", "sparse"),
        model_parallel=True,  # groups of any size: whether a model splits over them is its engine's to declare
        optimizer_offload=True,  # whether a model offloads is its engine's to declare (local: FSDP2 CPUOffloadPolicy)
        # a trained model on several ranks is FSDP2-sharded: weights and gradients too, gathered whole from
        # a forward to its backward and accumulated unsharded over a mini-batch's micro-steps (the local engine)
        numerics=msgspec.structs.replace(LOCAL_NUMERICS, sharded_states=True, gather_whole=True),
    )

    def __init__(self, registry: Any) -> None:
        super().__init__(registry)
        self.address: str | None = None  # an existing cluster to join (`flowrl run --address`)
        self._session = False  # inside `session`: Ray outlives each attempt's workers
        self._owns_ray = False  # a private Ray this executor started in its session, shut down at its end
        # nodes that lost a worker in an earlier attempt, until they answer a probe or leave the node table:
        # node id -> the probe task's ref (None until sent)
        self._suspects: dict[str, Any] = {}

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """The restarts of one run: Ray (private or joined) stays up between them; a private Ray this
        executor started is shut down at the end."""
        self._session = True
        try:
            yield
        finally:
            self._session = False
            self._suspects.clear()  # probes of this session's Ray
            if self._owns_ray:
                self._owns_ray = False
                import ray

                if ray.is_initialized():
                    ray.shutdown()

    def devices(self, plan: ExecutionPlan) -> int | None:
        """The GPUs (CPUs for a CPU plan) of the live Ray nodes; None before Ray is connected."""
        import ray

        if not ray.is_initialized():
            return None
        try:
            alive = self._live_nodes()
        except Exception:  # noqa: BLE001 - the cluster is unreachable: nothing can be placed
            return 0
        return sum(n.devices(not plan.target.cluster.on_cpu) for n in alive)

    def _live_nodes(self) -> list[ClusterNode]:
        """The alive nodes (`flowrl_ray.nodes.alive_nodes`) less those that lost a worker and do not run a probe
        task within `PROBE_S` (a crashed node Ray has not yet marked dead: what is placed there never starts)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from flowrl_ray import nodes

        found = nodes.alive_nodes()
        ids = {n.node_id for n in found}
        gone: set[str] = set()
        for node_id in list(self._suspects):
            if node_id not in ids:  # Ray marked it dead: it is simply not in the table any more
                del self._suspects[node_id]
                continue
            ref = self._suspects[node_id]
            first = ref is None
            if first:
                strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
                ref = self._suspects[node_id] = (
                    ray.remote(num_cpus=0)(_here).options(scheduling_strategy=strategy).remote()
                )
            ready, _ = ray.wait([ref], timeout=PROBE_S if first else 0)
            if not ready:
                gone.add(node_id)
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError:  # it ran there and failed (another flowrl there): alive
                pass
            except Exception:  # noqa: BLE001 - the task failed with its node: gone
                gone.add(node_id)
                continue
            del self._suspects[node_id]  # it answered: only the worker was lost
        return [n for n in found if n.node_id not in gone]

    def device(self, plan: ExecutionPlan) -> str:
        return "cpu" if plan.target.cluster.on_cpu else "cuda:0"  # Ray gives each GPU actor one visible device

    def launch(
        self, graph: Graph, plan: ExecutionPlan, schedule: Schedule, out_dir: Path
    ) -> tuple[RayTransport, dict[str, Any]]:
        import torch

        device = self.device(plan)
        gpus = device != "cpu"
        _user_functions_by_value()
        from flowrl_ray import nodes, shared

        nodes.check_tp_inside_nodes(plan)
        started = _connect(self.address, schedule.world, gpus)
        if started and self._session:  # kept for the session's next attempt; shut down when it ends
            self._owns_ray, started = True, False
        transport = RayTransport(schedule, started, self._suspects)
        try:
            found = self._live_nodes()  # a cluster of one node (a private Ray) holds every rank
            placed = nodes.assign(plan, schedule.world, found, private=len(found) == 1)
            if self.address:  # each node's CPUs shared by the ranks on it
                threads = plan.config.threads or nodes.threads_per_rank(placed)
            else:
                threads = plan.config.threads or max(1, (os.cpu_count() or 1) // schedule.world)
            torch.set_num_threads(1)  # the driver only routes batches; the cores are the workers'
            env = {"OMP_NUM_THREADS": str(threads), "RAY_USAGE_STATS_ENABLED": "0"}
            if "FLOWRL_PLUGINS" in os.environ:
                env["FLOWRL_PLUGINS"] = os.environ["FLOWRL_PLUGINS"]
            transport.start(threads, device, gpus, env, placed)
            table = nodes.node_table(placed, nodes.plan_nodes(plan, schedule.world))
            workers = [{**w, **t} for w, t in zip(transport.describe(), table)]
            (out_dir / "workers.json").write_text(json.dumps(workers, indent=1))
            shared.check(out_dir, placed, lambda method, args: transport.call(range(len(args)), method, args, "setup"))
            host, port = transport.call([0], "endpoint", [()], "setup")[0]
            init = f"tcp://{host}:{port}"
            args = [(graph.models, plan, schedule, init)] * schedule.world
            built_all = transport.call(list(range(schedule.world)), "setup", args, "setup")
        except BaseException:
            transport.close()
            raise
        built: dict[str, Any] = {}
        for part in built_all:
            for model, value in part.items():
                built.setdefault(model, value)
        return transport, built


def _connect(address: str | None, world: int, gpus: bool) -> bool:
    """Connect to Ray; returns whether this call started it (and so must shut it down)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():  # e.g. a test module's shared session
        return False
    if address:
        join(address)
        have = ray.cluster_resources()
        need = {"GPU" if gpus else "CPU": float(world)}
        short = {k: v for k, v in need.items() if have.get(k, 0.0) < v}
        if short:
            ray.shutdown()
            raise BackendError(
                f"the Ray cluster at {address} has {', '.join(f'{have.get(k, 0):g} {k}' for k in short)}; the plan "
                f"needs {', '.join(f'{v:g} {k}' for k, v in short.items())}. Plan for the cluster you have."
            )
        return True
    if gpus:
        import torch

        have = torch.cuda.device_count()
        if have < world:
            raise BackendError(
                f"the plan needs {world} GPUs; this machine has {have}. Join a cluster with --address, or plan "
                "--cluster cpu:N to run on this machine's CPU."
            )
    ray.init(
        address="local",
        num_cpus=max(world, os.cpu_count() or 1) if gpus else world,
        num_gpus=world if gpus else 0,
        include_dashboard=False,
        log_to_driver=False,
    )
    return True


def join(address: str) -> None:
    """Connect this process to the Ray cluster at ``address`` ('auto' or host:port)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    why = _unreachable(address)
    if why:  # Ray itself would retry for minutes before it gives up
        raise BackendError(
            f"no Ray cluster at --address {address} ({why}). Start one (`ray start --head` on its head node), "
            "check the host and port `ray start` printed, or drop --address to run on a private Ray on this machine."
        )
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise BackendError(
            f"no Ray cluster at --address {address} ({type(exc).__name__}: {exc}). Start one (`ray start "
            "--head` on its head node) or drop --address to run on a private Ray on this machine."
        ) from None


def _unreachable(address: str) -> str:
    """Why nothing answers at a ``host:port`` address (a TCP connection to its GCS port within
    `CONNECT_TIMEOUT_S`), or "" when something does, or the address is another form ('auto', ``ray://``)."""
    import socket

    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or "://" in address:
        return ""
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
            return ""
    except OSError as exc:
        return f"nothing answers at {host}:{port}: {exc.strerror or exc}"


def nodes(address: str) -> list[ClusterNode]:
    """The alive nodes of the Ray cluster at ``address`` (`flowrl_ray.nodes.discover`), which the planner
    plans for (`flowrl.planner.nodes`) when a run joins it with ``--address``."""
    from flowrl_ray.nodes import discover

    return discover(address)


class RayTransport:
    """The driver's handle on the worker actors."""

    def __init__(self, schedule: Schedule, owns_ray: bool, suspects: dict[str, Any] | None = None) -> None:
        self.schedule = schedule
        self.owns_ray = owns_ray
        self.suspects = suspects if suspects is not None else {}  # the node of a lost worker goes here
        self.placed: Sequence[ClusterNode] = ()
        self.actors: list[Any] = []
        self.pids: list[int] = []
        self.placement_groups: list[Any] = []
        self.iteration: int | None = None
        self.closed = False

    def group_of(self, rank: int) -> str:
        return next(g.name for g in self.schedule.groups if rank in g.ranks)

    def start(self, threads: int, device: str, gpus: bool, env: dict[str, str], placed: Sequence[Any]) -> None:
        """Start every rank's actor on its node (``placed``: each rank's `flowrl.contract.ClusterNode`): the
        ranks of a device group on one node share a placement group pinned there."""
        import ray
        from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.placed = placed
        remote = ray.remote(RayWorker)
        bundle = {"CPU": 1.0, "GPU": 1.0} if gpus else {"CPU": 1.0}
        for g in self.schedule.groups:
            on_node: dict[str, list[int]] = {}
            for rank in g.ranks:
                on_node.setdefault(placed[rank].node_id, []).append(rank)
            bundle_of: dict[int, tuple[Any, int]] = {}
            for node_id, ranks in on_node.items():
                pg = placement_group(
                    [dict(bundle)] * len(ranks),
                    strategy="STRICT_PACK",
                    name=f"flowrl-{g.name}-{node_id[:8]}",
                    bundle_label_selector=[{NODE_ID_LABEL_KEY: node_id}] * len(ranks),
                )
                self.placement_groups.append(pg)
                ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
                if not ready:
                    raise BackendError(
                        f"Ray could not place device group '{g.name}' ({len(ranks)} x {bundle} on "
                        f"{placed[ranks[0]].describe()}) within {PLACEMENT_TIMEOUT_S:.0f} s; the cluster has "
                        f"{ray.available_resources()} free."
                    )
                bundle_of.update({rank: (pg, i) for i, rank in enumerate(ranks)})
            for rank in g.ranks:
                pg, i = bundle_of[rank]
                actor = remote.options(
                    num_cpus=1,
                    num_gpus=1 if gpus else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                    runtime_env={"env_vars": env},
                    max_restarts=0,
                    name=None,
                ).remote(rank, self.schedule.world, None, threads, device)
                self.actors.append(actor)
        self.pids = self.call(list(range(self.schedule.world)), "pid", [()] * self.schedule.world, "setup")
        where = self.call(list(range(self.schedule.world)), "node_id", [()] * self.schedule.world, "setup")
        wrong = [r for r, n in enumerate(where) if n != placed[r].node_id]
        if wrong:
            raise BackendError(
                f"Ray placed worker rank {wrong[0]} on node {where[wrong[0]][:12]}, not on its planned "
                f"{placed[wrong[0]].describe()}."
            )

    def describe(self) -> list[dict[str, Any]]:
        return [{"rank": r, "group": self.group_of(r), "pid": pid} for r, pid in enumerate(self.pids)]

    def call(self, ranks: Sequence[int], method: str, args: Sequence[tuple[Any, ...]], tag: str) -> list[Any]:
        import ray

        refs = [self.actors[r].call.remote(method, tag, *a) for r, a in zip(ranks, args)]
        rank_of = {ref: r for ref, r in zip(refs, ranks)}
        results: dict[Any, Any] = {}
        errors: list[tuple[int, Exception]] = []
        pending = list(refs)
        while pending and not errors:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            for ref in ready:
                try:
                    results[ref] = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                    errors.append((rank_of[ref], exc))
        if errors:
            self._raise(errors, tag)
        return [results[ref] for ref in refs]

    def _raise(self, errors: list[tuple[int, Exception]], tag: str) -> None:
        """Report the root cause: a worker that died (its peers then fail in their collectives), else
        the first worker's error; a user-fixable error raised inside a worker keeps its type."""
        import ray

        dead = self._dead()
        if dead:
            self._died(dead[0], tag, None)
        rank, exc = errors[0]
        if isinstance(exc, ray.exceptions.RayTaskError):
            cause = exc.cause  # the worker's own exception, without Ray's traceback text
            if isinstance(cause, FlowRLError):
                self.close()
                raise type(cause)(*cause.args) from None
        if isinstance(exc, ray.exceptions.RayActorError):
            self._died(rank, tag, exc)
        self._fail(rank, tag, "failed", exc)

    def _dead(self) -> list[int]:
        """Ranks whose actor is gone (asked with a short timeout)."""
        import ray

        refs = {a.pid.remote(): r for r, a in enumerate(self.actors)}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=3.0)
        dead = []
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.append(refs[ref])
        return sorted(dead)

    def _died(self, rank: int, tag: str, exc: Exception | None) -> None:
        """A worker's process or node is gone: `WorkerLostError` (the run may restart from a checkpoint)."""
        if rank < len(self.placed):  # its node may be gone too: probed before anything is placed there again
            self.suspects.setdefault(self.placed[rank].node_id, None)
        self._fail(rank, tag, "died", exc, lost=True)

    def _fail(self, rank: int, tag: str, what: str, exc: Exception | None, lost: bool = False) -> None:
        pid = self.pids[rank] if rank < len(self.pids) else None
        when = f"in iteration {self.iteration}" if self.iteration is not None else "during setup"
        cause = str(exc).strip().splitlines() if exc is not None else []
        detail = f": {cause[-1]}" if cause else ""
        stopped = "the run is stopped and Ray shut down" if self.owns_ray else "the run and its workers are stopped"
        self.close()
        group = self.group_of(rank)
        message = (
            f"worker rank {rank} (device group '{group}', pid {pid if pid is not None else '?'}) {what} {when}, task "
            f"'{tag}'{detail}; {stopped}. metrics.jsonl holds the iterations that finished."
        )
        if lost:
            raise WorkerLostError(
                message, rank=rank, pid=pid, group=group, iteration=self.iteration, task=tag
            ) from None
        raise BackendError(message) from None

    def spans(self) -> dict[int, list[tuple[str, float, float]]]:
        import ray

        if self.closed:
            return {}
        ranks = list(range(len(self.actors)))
        try:
            return dict(zip(ranks, ray.get([a.spans.remote() for a in self.actors], timeout=30)))
        except ray.exceptions.RayActorError as exc:  # a worker lost between calls: the same failure path
            self._raise([(0, exc)], "spans")  # names the worker that is gone
            raise  # pragma: no cover - _raise always raises

    def close(self) -> None:
        """Stop the workers and, when this run started Ray, Ray itself. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        import ray

        if not ray.is_initialized():
            return
        try:  # engines with processes of their own (vLLM) stop them before their worker is killed
            ray.wait([a.close_engines.remote() for a in self.actors], num_returns=len(self.actors), timeout=30)
        except Exception:  # noqa: BLE001 - dead workers close nothing
            pass
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        from ray.util.placement_group import remove_placement_group

        for pg in self.placement_groups:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        if self.owns_ray:
            deadline = time.time() + 10
            ray.shutdown()
            while ray.is_initialized() and time.time() < deadline:  # pragma: no cover - shutdown is synchronous
                time.sleep(0.1)


def _here() -> bool:
    """The probe task: it runs, so its node is alive."""
    return True


def _user_functions_by_value() -> None:
    """What a graph file registered (its losses run on the workers) travels there by value: the
    file is imported under a name the workers cannot import."""
    import sys

    from ray import cloudpickle

    for name, module in list(sys.modules.items()):
        if name.startswith("flowrl_user_graph_"):
            cloudpickle.register_pickle_by_value(module)
