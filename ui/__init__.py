"""The app's Gradio UI, one module per tab (`app.py` assembles them); shared pieces in `ui.common`.

UI only: validation, model work, figures and the tabs' logic live in `lab`, `strategies` and `visualizers`.
"""
