"""The train loop and what only it uses: FoldTrainer on torchtitan's components, its checks, optimizer, metrics, guards."""
