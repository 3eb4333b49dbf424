"""The effective-training-time simulation: model.py (the discrete-event simulation of both loops), stats.py
(the summary over seeds), report.py (`orchestrator simulate`: inputs, the priced costs, the table),
slow_schedule.py (slow hours and what each loop does about them). Pure, seeded."""
