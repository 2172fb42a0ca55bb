"""Fine-tuning evaluation: the seed's TrainBERT / FreezeBERT protocol.

``python -m pipeline finetune MODEL`` fine-tunes a copy of the encoder on small labelled tasks
(classification: a linear head and cross-entropy; similarity: the two sentences encoded separately,
(1 + cos) / 2 against the label with binary cross-entropy, or CoSENT), in two regimes: *train* (all
weights, LUSE's TrainBERT) and *freeze* (the encoder frozen, its pooled outputs computed once and
cached, a small MLP trained over them: LUSE's FreezeBERT). The learning rate is chosen per seed on the
dev split; the test split is scored once per (task, regime, seed, lr) cell. See docs/finetune.md.
"""
