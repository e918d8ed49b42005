"""The examples, apart from the library (not in the wheel; run from a clone): the digits data and
CNN (:mod:`.digits`), their mmengine dataset, model and metric for the configs in ``configs/``
(:mod:`.mmengine_digits`), their LightningModule for ``configs/lightning/`` (:mod:`.lightning_digits`,
``python -m examples.lightning_digits fit --config ...``), and the demo experiment (:mod:`.demo`, ``make demo`` or
``python -m examples.demo``). They need the ``examples`` extra and import the adapters, which never
import them (nor does ``fused_optim``)."""
