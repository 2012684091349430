DROP TABLE attempt_intents;
