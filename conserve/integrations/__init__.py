"""conserve.integrations: callbacks for training frameworks (HF Trainer, Lightning)."""
