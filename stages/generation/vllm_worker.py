"""What a vLLM server needs to take new weights from disk correctly: a worker extension.

Loaded inside the vLLM server (`--worker-extension-cls stages.generation.vllm_worker.WeightSync`,
with this repository on its PYTHONPATH); called by `stages.weights.push` through vLLM's
`/collective_rpc`. Imports nothing of offseason: it runs in vLLM's own environment.

Why it exists: vLLM's `reload_weights` (0.32) reloads layer by layer into fresh tensors, and a
weight two modules share (tied input and output embeddings, as Qwen2.5 and Qwen3's small models
have) comes back untied: the output layer keeps the old weights, and the server answers with a
mix of old and new (measured: every probe token differed). `offseason_reload` reloads, then
ties again what was tied before and prepares the re-tied layers' kernels again. It never raises:
a worker that raises in a collective call takes the whole server down (measured on vLLM 0.32),
so failures come back as the call's result.
"""


class WeightSync:
    """Mixed into vLLM's worker class; `self.model_runner` is the worker's."""

    def offseason_reload(self, weights_path: str) -> str:
        """Reload the weights of the model folder `weights_path`, keep tied weights tied;
        returns "ok: <n> tied groups kept" or "error: <why>".
        """
        try:
            model = self.model_runner.get_model()
            shared: dict[int, list[str]] = {}
            for name, param in model.named_parameters(remove_duplicate=False):
                shared.setdefault(id(param), []).append(name)
            tied = [names for names in shared.values() if len(names) > 1]
            self.model_runner.reload_weights(weights_path=weights_path)
            for names in tied:
                # the first name in module order is the one the checkpoint holds (the input
                # embeddings come before the output layer)
                source = model.get_parameter(names[0])
                for name in names[1:]:
                    owner, _, attribute = name.rpartition(".")
                    module = model.get_submodule(owner)
                    setattr(module, attribute, source)
                    # on CPU the layer computes through a kernel prepared from its weight at
                    # load time (vLLM's dispatch_cpu_unquantized_gemm): prepare it again
                    method = getattr(module, "quant_method", None)
                    if method is not None and hasattr(method, "process_weights_after_loading"):
                        method.process_weights_after_loading(module)
            return f"ok: {len(tied)} tied groups kept"
        except Exception as err:  # noqa: BLE001 - a raise here ends the server
            return f"error: {type(err).__name__}: {err}"
