"""The examples, apart from the library: the digits data and CNN (:mod:`.digits`), their mmengine
dataset, model and metric for the configs in ``configs/`` (:mod:`.mmengine_digits`), and the
``fused-optim demo`` experiment (:mod:`.demo`). Shipped in the wheel so the installed
``fused-optim demo`` runs; they need the ``examples`` extra and import the adapters, which never
import them (nor does the rest of ``fused_optim``)."""
