# scikit-learn's 8×8 digits (ships with scikit-learn: no download). 1438 train / 359 val images.
# Registered by examples.mmengine_digits: a config using this names it in custom_imports.
train_dataloader = dict(
    batch_size=32,
    num_workers=0,
    sampler=dict(type='DefaultSampler', shuffle=True),
    collate_fn=dict(type='default_collate'),
    dataset=dict(type='DigitsDataset', split='train'),
)
val_dataloader = dict(
    batch_size=128,
    num_workers=0,
    sampler=dict(type='DefaultSampler', shuffle=False),
    collate_fn=dict(type='default_collate'),
    dataset=dict(type='DigitsDataset', split='val'),
)
val_evaluator = dict(type='DigitsAccuracy')
val_cfg = dict()
