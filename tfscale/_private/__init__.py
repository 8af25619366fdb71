"""Every private TensorFlow/Keras API that tfscale uses, and nothing else.

The bottom layer of tfscale: it imports nothing of tfscale; what it needs
(key ranges, reducers, predicates) is passed in. Five modules use them:
`tf_collectives` (TensorFlow's collectives and MWMS's all-reduce),
`keras_hooks` (Keras's methods routed), `accessors` (state with no public
accessor), `graph_order` (how `tf.function` traces tfscale's code: not
converted by autograph, its timestamps and bookkeeping ops placed),
`host_input` (distributed datasets a CPU worker reads on its host). A
sixth, `hooks`, checks that each of their private uses is where they
expect it.

TensorFlow exports no hook for replacing how MultiWorkerMirroredStrategy
all-reduces, nor the raw collective ops over sub-groups of its cluster; tfscale
needs both. Those uses are confined to this module so that a TensorFlow or
Keras upgrade has one place to check; tests/test_private_api.py fails if any
other module touches a private attribute. Each use, what it is for, and the
test that fails loudly when it stops working on the tested versions
(tfscale/_version.py). At `tfscale.Strategy()`, `hooks.check` refuses to go
on where one of them is gone or its signature changed, naming it, and warns
once on an untested version where all of them fit:

- `CollectiveAllReduce._all_reduce` (overridden by
  `TfscaleCollectiveAllReduce`) and `strategy.extended._cross_device_ops`:
  route Keras's gradient, loss and metric all-reduces to tfscale.
  tests/test_strategy.py, test_gradients_are_routed_through_tfscale_cross_device_ops.
- `_TimedCollectiveAllReduce`: times stock MWMS's own all-reduces for the
  benchmarks. tests/test_strategy.py, test_stock_strategy_times_its_all_reduces.
- `CollectiveReplicaLauncher._next_instance_key` (overridden by
  `_LoopSafeLauncher`, installed in every `CollectiveAllReduce` tfscale's
  strategies use, as its `_launchers`): collectives that Keras runs in
  its `steps_per_execution` while loop get an instance key fixed when traced,
  because TensorFlow never feeds the call-time key there (see the class).
  tests/test_steps_per_execution.py, test_loop_instance_keys_are_fixed_at_trace_time.
- `CollectiveReplicaLauncher` / `CollectiveKeys` / `collective_ops`: raw
  collectives over sub-groups of the cluster (`CollectiveGroup`).
  tests/test_collectives.py (float64-oracle all-reduces of every algorithm).
  On the NCCL path every group of a worker takes the ordering token of one
  launcher (`_get_ordering_token`), so that `tf.function`'s automatic
  control dependencies chain all its NCCL collectives; `standalone_group`
  builds a group outside a strategy to trace that graph on CPU.
  tests/test_nccl_graph.py, test_nccl_chains_every_collective_of_a_worker_in_one_shared_order.
- `MultiWorkerMirroredStrategy._collective_key_base`: fresh group keys for
  each Strategy built in one process (`take_collective_keys`), and
  `context.wait_at_barrier`, the coordination service's barrier that keeps
  workers from using a new strategy's collectives before every worker has
  re-enabled them (`wait_for_all_workers`). tests/test_collectives.py, where
  each configuration is its own Strategy (it hung without the barrier), and
  tests/test_strategy.py, test_several_strategies_train_in_one_process.
  The same `context.coordination_service` tells `cluster_connected`, so that
  only a process's first strategy waits for its peers (`tfscale.startup`):
  tests/test_startup.py, which needs the wait, and
  test_several_strategies_train_in_one_process, where a second wait would
  find the port held by TensorFlow.
- `context.configure_coordination_service`, `context.coordination_service`'s
  `heartbeat_timeout_in_ms`, `context._coordination_service_config` (reset
  when MWMS's `__init__` fails), `multi_worker_util.normalize_cluster_spec`
  and `coordination_leader`, and `CoordinatedJob` from
  `tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2`
  (`heartbeats_configured`): the coordination service configured as MWMS
  configures it, with tfscale's heartbeat timeout in place of TensorFlow's
  10 s, before MWMS's `__init__` (which then keeps it).
  tests/test_heartbeats.py: a chief stopped for 12 s stops the job under
  `heartbeat_timeout_seconds=10` and not under the default; a strategy that
  fails to build leaves nothing configured.
- `extended._cluster_resolver`, `extended._in_multi_worker_mode`: the
  cluster MWMS resolved. tests/test_topology.py, tests/test_strategy.py.
- `tensorflow.python.framework.config.is_op_determinism_enabled`
  (`accessors.op_determinism_enabled`): under op determinism
  `algorithm="auto"` takes the cost model's choice instead of timing its
  candidates. tests/test_autotune.py,
  test_under_op_determinism_auto_takes_the_cost_models_choice_and_tries_nothing.
- `Model._flatten_layers` (`flatten_layers`): every nested layer, to find
  BatchNorm statistics. tests/reliability/test_batch_norm_sync.py.
- Keras's `seed_generator_state` variable path (`seed_generator_states`):
  Dropout's random state, which `tf.train.Checkpoint` does not reach through
  the model. tests/reliability/test_resume.py (bitwise-equal resume).
- The name `LossScaleOptimizer` in `keras.src.trainers.trainer`, which
  `Model.compile` wraps its optimizer in under `mixed_float16`
  (`route_compile_loss_scaling`): under a `tfscale.Strategy` compile builds
  `tfscale.optimizers.LossScaleOptimizer`. tests/test_loss_scale.py,
  test_compile_wraps_in_tfscale_loss_scale_under_a_tfscale_strategy (one
  process) and test_keras_guide_mixed_float16_fit_agrees_to_skip (2 workers).
- `TFOptimizer._backend_apply_gradients` (replaced by
  `route_optimizer_updates`; it calls Keras's `_clip_gradients`,
  `_apply_weight_decay`, `_distributed_tf_update_step`,
  `_backend_increment_gradient_accumulators`,
  `_backend_reset_gradient_accumulators`, `_accumulated_gradients`,
  `_get_variable_index`, `_iterations`): under a `tfscale.Strategy` every Keras
  optimizer all-reduces its gradients first, then clips and decays the
  all-reduced gradient, and accumulates local gradients with one all-reduce
  per accumulated step (`gradient_accumulation_steps`); with
  `compression="powersgd"` the strategy's `powersgd` sums the gradients
  there (tests/test_powersgd.py).
  tests/test_accumulation.py, test_hook_is_installed_on_keras_optimizers
  (one process) and its 2-worker tests. `_iterations` also gives
  `batches_taken`, the data position checkpoints record:
  test_tfscale_train_accumulation_steps.
- `Model._initial_epoch` (`set_initial_epoch`): the epoch a `fit` already
  under way starts from, as Keras's own BackupAndRestore sets it.
  tests/test_backup_and_restore.py, test_resumes_at_the_saved_step.
- `fit` calling `keras.callbacks.CallbackList.set_model` before training
  and `on_train_end` after it (`add_fit_hooks`): where tfscale sees the
  user's callbacks, which `fit` gets and the strategy does not.
  tests/test_fit_hooks.py, test_fit_calls_the_hooks.
- `fit` calling `CallbackList.on_train_batch_end` in its loop's thread
  after each batch, and looking `model.train_function` up again for the
  next (`add_train_batch_end_hook`, `retrace_train_function`): algorithm
  "auto" has Keras build the train function anew once it has chosen, at
  the same batch on every worker. tests/test_autotune.py,
  test_four_workers_by_default_try_each_candidate_and_threshold_agree_on_one_choice_and_match_the_ring
  (the tuner stops counting steps at the decision: the function was
  traced again); tests/test_backup_and_restore.py,
  test_a_train_function_built_anew_mid_fit_goes_under_the_backups_wrapper
  (the name of the function Keras returns, checked by
  test_only_keras_functions_or_tfscale_wrappers_of_them_are_built_anew).
- `keras.src.losses.loss.scale_loss_for_distribution` and
  `unscale_loss_for_distribution` (`route_loss_scaling`): Keras's
  `1 / num_workers` loss scaling, which Keras's losses, its train and test
  steps and its loss metrics look up in that module, becomes each worker's
  share of the step's examples under a `tfscale.Strategy`
  (`tfscale.uneven_data`).
  tests/test_uneven_data.py, test_keras_looks_up_the_routed_loss_scaling.
- Keras's step functions (`keras_step`): `fit` and `evaluate` pass the
  model's bound `train_step` / `test_step` to `strategy.run`, `predict` its
  local `one_step_on_data`; their batches are padded where empty
  (`tfscale.uneven_data`).
  tests/test_uneven_data.py (3 workers, a worker without examples in
  fit, evaluate and predict).
- `DistributedDatasetsFromFunction._cardinality` and
  `_enable_get_next_as_optional` (`set_cardinality`): the batches of each
  worker's own pipeline, which Keras runs as many steps of, agreed among the
  workers (`tfscale.uneven_data.agreed_cardinality`).
  tests/test_uneven_data.py, the `ran_out` scenario (workers whose pipelines
  hold 2, 3 and 4 batches).
- `input_util.get_distributed_dataset` and
  `get_distributed_datasets_from_function`, with MWMS's
  `_input_workers_with_options` and `_make_input_context`
  (`host_input`): without the user's `InputOptions`, a CPU worker's
  distributed datasets are built as MWMS builds them, with the options
  under which TensorFlow reads them with a plain iterator on the host
  (`input_lib._should_use_multi_device_iterator`) instead of tracing a
  MultiDeviceIterator for every iterator made. `DistributedIterator`'s
  `_iterators` and their `_iterator` tell which (`reads_on_host`).
  tests/test_host_input.py.
- `TensorFlowTrainer._maybe_symbolic_build` (`route_symbolic_build`): Keras
  builds the model from the first batch MEAN-reduced over the workers, which
  fails when their batches differ in size (a global batch 3 workers cannot
  share); it is built from this worker's batch instead.
  tests/test_uneven_data.py, test_symbolic_build_is_routed.
- `context.context().abort_collective_ops` (`abort_collectives`): the
  collective timeout of tfscale's collectives, kept by one watchdog thread
  per worker instead of TensorFlow's thread per timed op
  (`tfscale.collectives.watchdog`). tests/test_watchdog.py,
  test_a_stalled_worker_fails_the_others_after_the_timeout.
- autograph's `config.CONVERSION_RULES` and `config_lib.DoNotConvert`, which
  `conversion.is_allowlisted` reads (`graph_order.trace_unconverted`): a
  user's `tf.function` that calls tfscale (a custom loop's
  `strategy.reduce`) runs tfscale's code as written, as it runs
  TensorFlow's and Keras's, instead of converting it again at every trace.
  tests/test_strategy.py,
  test_a_custom_loop_runs_tfscales_reduce_as_written_not_converted_by_autograph.
- `auto_control_deps.ASYNC_STATEFUL_OPS` (`graph_order.unorder_timestamps`):
  with the timeline on, `tf.timestamp` joins the ops `tf.function` does not
  run in program order, so that a stamp after one bucket's result holds back
  no later bucket. tests/test_timeline.py,
  test_the_hook_lets_timestamps_run_where_their_inputs_put_them (and the
  4-worker test, whose spans nest).
- `Graph.experimental_acd_manager.run_independently`
  (`graph_order.unordered`): the watchdog's fetch-and-add of its counter
  and the flight recorder's issue stamp and row run once their inputs are
  ready, not in program order after the bookkeeping of earlier collectives,
  so that no gradient bucket waits for the previous one's completion or
  for the last gradient. tests/test_collective_order.py.
- `control_flow_util.GraphOrParentsInXlaContext` (`in_xla_context`): whether
  the function being traced is compiled by XLA (`jit_compile=True`), as MWMS
  asks it to choose between merge_call and not; XLA has no kernel for
  `tf.timestamp`, so compiled steps go untimed.
  tests/test_fit_hooks.py, test_in_xla_context_sees_jit_compile.
"""
