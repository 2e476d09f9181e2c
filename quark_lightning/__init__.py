"""quark-lightning's application: the Hydra app (``quark_lightning.app``), its demo tasks
(``quark_lightning.tasks``) and the ``quark-lightning`` command (``quark_lightning.train:main``, what ``python train.py``
runs). The engine is ``quark``, the Lightning front end ``callbacks``."""
