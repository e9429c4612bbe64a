"""What a warm server imports once, before it forks runs: every module each run imports
(with the import-time shims), nothing run-specific (per-loop shims and patches are applied
in each forked run, never in the server)."""

from __future__ import annotations

import contextlib
import gc
import importlib


def preload() -> None:
    """Import what every run imports (with the import-time shims), nothing run-specific:
    per-loop shims and patches are applied in each forked child, never in the server."""
    from contract_lib.child import shims
    from contract_lib.sources import backports, compat

    shims.import_all()
    shims.install_import_shims()
    backports.install_import_compat()
    import sglang.srt.hardware_backend.mlx.model_runner  # noqa: F401
    import sglang.srt.hardware_backend.mlx.model_runner_stub  # noqa: F401
    if importlib.util.find_spec("sglang.srt.hardware_backend.mlx.runtime"):  # 0.5.19+
        import sglang.srt.hardware_backend.mlx.runtime  # noqa: F401
    import mlx_lm.models.llama  # noqa: F401  (the tiny model of the real MLX runner)
    import sglang.srt.hardware_backend.mlx.scheduler_mixin  # noqa: F401
    import sglang.srt.hardware_backend.mlx.tp_worker  # noqa: F401
    import sglang.srt.managers.scheduler  # noqa: F401

    # Every model class (the Scheduler build looks its architecture up here): ~1 s of a
    # warm build otherwise, paid once here instead of in every forked run.
    import sglang.srt.models.registry  # noqa: F401
    import sglang.srt.server_args  # noqa: F401

    for name in compat.BUILD_IMPORTS:  # what each Scheduler build would import afresh
        with contextlib.suppress(ImportError):  # a release without it
            importlib.import_module(name)

    import contract_lib.child.capture.recorder  # noqa: F401  (every hook module)
    import contract_lib.child.main  # noqa: F401
    from contract_lib.sources.user_modules import remember_loaded_modules

    remember_loaded_modules()  # after every import above
    # Move what the imports left into the permanent generation (after collecting their
    # garbage): a forked run's collections then skip SGLang's ~10^6 objects, and do not
    # write to their pages (which copy-on-write would duplicate in every run).
    gc.collect()
    gc.freeze()
