"""The train loop and what only it uses: FoldTrainer on torchtitan's Trainer, its checks, optimizer, metrics, guards."""
