DROP TABLE group_counts;
