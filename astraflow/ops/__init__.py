"""The operator's commands: everything `astraflow` does besides parsing its arguments (`cli`).

`context` (settings, Redis, bus), `start` (run, raas, trainer, dataflow), `top`, `record`, `inspect`,
`audit` (ledger, trace), `scale` and `scale_plan`, `health`, `admin` (redis, clear, workflow push),
`track`, `models` (export, model tiny). The top floor: these modules use the services' public modules,
and no module below imports them.
"""
